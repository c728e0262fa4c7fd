"""Compile the C++ ops DeepSpeed loads at run time on this machine, once, at ``make test``.

DeepSpeed builds an op the first time a run needs it (``torch.utils.cpp_extension``, cached in
``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``), which costs a minute or more of
two cores inside that run. Built here instead:

* ``CPUAdamBuilder``: ``DeepSpeedCPUAdam``, the optimizer of ZeRO's CPU offload;
* ``ShareMemCommBuilder``: the shared-memory all-reduce of DeepSpeed's CPU accelerator (ZeRO on CPU).

Each is built through the current accelerator's op builder, as DeepSpeed itself loads it; an op the
accelerator has no builder for (the shared-memory one on CUDA) or that it reports incompatible is
skipped with a line saying so. A build error stops ``make test``.
"""

from __future__ import annotations

import sys
import time

OPS = ("CPUAdamBuilder", "ShareMemCommBuilder")


def main() -> int:
    try:
        from deepspeed.accelerator import get_accelerator
    except ImportError:
        print("build_deepspeed_ops: deepspeed is not installed; nothing to build")
        return 0
    accelerator = get_accelerator()
    for name in OPS:
        builder = accelerator.create_op_builder(name)
        if builder is None or not builder.is_compatible(verbose=False):
            print(f"build_deepspeed_ops: {name}: not available for DeepSpeed's {type(accelerator).__name__}, skipped")
            continue
        t0 = time.monotonic()
        builder.load(verbose=False)
        print(f"build_deepspeed_ops: {builder.absolute_name()} ready ({time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
