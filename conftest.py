"""Every pytest run in this repository (tests/ and nbval's run of chapters/): notebook kernels over IPC.

jupyter_client starts a kernel over TCP by default: it finds five free ports by binding and closing them,
writes them to the connection file, and the kernel binds them a moment later. Two kernels starting at once
(nbval here, the site build or another nbval run beside it) can be handed the same port, and the later one
dies with ``ZMQError: Address already in use``. Over IPC each kernel's sockets are files at a path of its
own, so kernels cannot collide. nbval makes its ``KernelManager`` without any configuration, so the class it
uses is swapped for one whose defaults are IPC and a fresh socket path; scripts/build_site.py sets the same
two options on nbclient's kernel manager.
"""

from __future__ import annotations

import os
import tempfile
import uuid
import warnings

try:
    import nbval.kernel
    from jupyter_client.manager import KernelManager
    from traitlets import default
except ImportError:  # without the lab extras there are no notebooks to run
    nbval = None


if nbval is not None and os.name != "nt":  # zmq has no IPC transport on Windows

    class IpcKernelManager(KernelManager):
        """A kernel manager whose kernels listen on Unix sockets ``<tmp>/minserve-kernel-<id>-1…5``."""

        @default("transport")
        def _transport_default(self) -> str:
            return "ipc"

        @default("ip")
        def _ip_default(self) -> str:
            # jupyter_client's IPC default, "kernel-ipc" in the working directory, is shared by every kernel
            # started there; this path is this kernel's alone (jupyter_client removes the sockets at shutdown).
            return os.path.join(tempfile.gettempdir(), f"minserve-kernel-{uuid.uuid4().hex[:12]}")

    if nbval.kernel.KernelManager is KernelManager:
        nbval.kernel.KernelManager = IpcKernelManager
    else:  # nbval changed how it makes kernels: the notebooks still run, over TCP
        warnings.warn("nbval.kernel no longer uses jupyter_client's KernelManager; kernels stay on TCP", stacklevel=1)
