"""Make the C++ ops DeepSpeed loads at run time ready on this machine, once, at ``make test``.

The ops:

* ``CPUAdamBuilder``: ``DeepSpeedCPUAdam``, the optimizer of ZeRO's CPU offload;
* ``ShareMemCommBuilder``: the shared-memory all-reduce of DeepSpeed's CPU accelerator (ZeRO on CPU).

Without this, DeepSpeed compiles an op the first time a run needs it, into torch's extension cache
(``$TORCH_EXTENSIONS_DIR``), which costs a minute or more of two cores inside that run; and that
cache is rebuilt for every new clone, because its build files name the virtual environment's path.

On DeepSpeed's CPU accelerator, DeepSpeed is reinstalled from a wheel built with these ops
(``DS_BUILD_CPU_ADAM=1 DS_BUILD_SHM_COMM=1``, DeepSpeed's own way of prebuilding ops), which
:mod:`wheel_cache` keeps per machine: the first set-up builds it (about 2.5 min of 2 cores), every
later one, from any clone, installs it in seconds. Each op is then loaded in a fresh interpreter to
check that DeepSpeed finds it prebuilt. On another accelerator (CUDA), each op is built through that
accelerator's op builder into torch's extension cache, as DeepSpeed itself would at first use; an op
the accelerator has no builder for (the shared-memory one on CUDA) or reports incompatible is skipped
with a line saying so. A build error stops ``make test``.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

OPS = ("CPUAdamBuilder", "ShareMemCommBuilder")

#: run in a fresh interpreter after the reinstall: every op must load as DeepSpeed's prebuilt one
CHECK = """
import sys
from deepspeed.accelerator import get_accelerator
from deepspeed.git_version_info import installed_ops
accelerator = get_accelerator()
for name in sys.argv[1:]:
    builder = accelerator.create_op_builder(name)
    if not installed_ops.get(builder.NAME):
        sys.exit(f"build_deepspeed_ops: the installed DeepSpeed does not have {builder.NAME} prebuilt")
    builder.load(verbose=False)
    print(f"build_deepspeed_ops: {builder.absolute_name()} ready (prebuilt)")
"""


def install_prebuilt(accelerator, builders: dict) -> None:
    """DeepSpeed reinstalled from the cached wheel with ``builders``' ops prebuilt (``{class name: builder}``)."""
    import deepspeed

    env = ["DS_BUILD_OPS=0", f"DS_ACCELERATOR={accelerator._name}", *(f"{b.BUILD_VAR}=1" for b in builders.values())]
    variant = f"{accelerator._name}-" + "+".join(sorted(b.NAME for b in builders.values()))
    wheel_cache = Path(__file__).with_name("wheel_cache.py")
    subprocess.run([sys.executable, str(wheel_cache), f"deepspeed=={deepspeed.__version__}", "--variant", variant,
                    "--native", *(f"--env={e}" for e in env)], check=True)
    subprocess.run([sys.executable, "-c", CHECK, *builders], check=True)


def main() -> int:
    try:
        from deepspeed.accelerator import get_accelerator
    except ImportError:
        print("build_deepspeed_ops: deepspeed is not installed; nothing to build")
        return 0
    accelerator = get_accelerator()
    builders = {}
    for name in OPS:
        builder = accelerator.create_op_builder(name)
        if builder is None or not builder.is_compatible(verbose=False):
            print(f"build_deepspeed_ops: {name}: not available for DeepSpeed's {type(accelerator).__name__}, skipped")
            continue
        builders[name] = builder
    if accelerator._name == "cpu":
        install_prebuilt(accelerator, builders)
        return 0
    for builder in builders.values():
        t0 = time.monotonic()
        builder.load(verbose=False)
        print(f"build_deepspeed_ops: {builder.absolute_name()} ready ({time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
