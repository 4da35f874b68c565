"""What the exit status of ``pagedchat serve`` says, for whoever restarts it (systemd, compose, a shell)."""

from __future__ import annotations

# a normal stop (SIGTERM, Ctrl-C) is 0
# start-up failed for another reason than the operator's (a bug, the device)
START_FAILED = 1
# a mistake of the operator's (a flag, the port, Redis, the model): one line says what to fix
CONFIG_ERROR = 2
# the engine failed, or a front process died while the others served: a supervisor restarts the server
ENGINE_DIED = 3
