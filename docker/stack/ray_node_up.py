"""Health check of a stack container in the Ray cluster: its raylet (a node) or GCS server
(the head) runs. Cheap on purpose (no `ray` import): it runs every few seconds per container.
Exit status 0 when it does."""

import os
import sys

wanted = b"gcs_server" if "--head" in sys.argv else b"raylet"
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            program = cmdline.read().split(b"\0")[0]
    except OSError:
        continue
    if program.endswith(wanted):
        sys.exit(0)
sys.exit(f"no {wanted.decode()} runs in this container")
