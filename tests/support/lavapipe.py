"""Edge tests' work in a spawned process: its IREE context is the process's first on lavapipe
(later contexts of one process lose the device far more often: IreeRunner's docstring).

Mesa 22.3's lavapipe loses the device now and then past the context's first upload too (one in
a CI run of the whole suite, at a token's readback in the third decode step). The runtime's own
answer is a new device and the work again (src/edge/runtime.py, lavapipe_retry); here the work
runs again in a new process, a new Vulkan instance, LAVAPIPE_TRIES in all, each retry a warning
in the test's output; a context IreeRunner could not make in its own tries (ModuleLoadFailed, a lost
device each time) is tried again too, in the new process. Any other error fails at once, and so does
a loss on any other driver."""
from __future__ import annotations

import multiprocessing
import warnings
from concurrent.futures import ProcessPoolExecutor

import pytest

from src.edge.runtime import LAVAPIPE_TRIES, lost_device, on_lavapipe, vulkan_device_names

needs_vulkan = pytest.mark.skipif(not vulkan_device_names(), reason="no Vulkan driver (apt-get install mesa-vulkan-drivers)")


def in_own_process(fn, *args):
    """fn(*args) in a spawned process (see the module docstring); returns its result."""
    lavapipe, tries = on_lavapipe(), 1
    while True:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            try:
                return pool.submit(fn, *args).result()
            except RuntimeError as err:
                if not (lavapipe and lost_device(str(err))) or tries == LAVAPIPE_TRIES:
                    raise
                warnings.warn(f"lavapipe lost the device in {fn.__name__} (try {tries} of {LAVAPIPE_TRIES}); again in a new process: {err}",
                              stacklevel=2)
        tries += 1
