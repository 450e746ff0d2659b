"""Whether a host can be reached: one quick probe (DNS + TCP to port 443 in a
background thread) that never blocks for long, asked before a download so
that an offline machine fails at once with what to do instead."""

from __future__ import annotations

import socket
import threading


def online(host: str, timeout: float = 4.0) -> bool:
  """True if ``host`` accepts a TCP connection on port 443 within
  ``timeout`` seconds."""
  ok = []

  def probe():
    try:
      socket.create_connection((host, 443), timeout=timeout).close()
      ok.append(True)
    except OSError:
      pass

  t = threading.Thread(target=probe, daemon=True)
  t.start()
  t.join(timeout + 1.0)
  return bool(ok)
