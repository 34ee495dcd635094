"""Suite-wide setup.  The suite runs on CPU: Triton kernels run in its interpreter.  ``triton.jit`` reads
``TRITON_INTERPRET`` when a kernel module is imported, so it is set here, before any test module imports
one; setting it per test module made the outcome depend on which module the run imported first.  (The sm_90
compile test runs its compiler in a subprocess with the interpreter off.)"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
