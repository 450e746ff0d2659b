"""Faithful copies of reference implementations (Apache-2.0, with their
headers and source commits), used only by the tests."""
