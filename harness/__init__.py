"""The harness: the model zoo, a driver for the engine, golden files from HF, parity, sampling tests, benchmarks."""

from __future__ import annotations

# Exit status of every verb (python -m harness VERB), the contract a CI gates on; harness/__main__.py says more.
EXIT_PASS = 0  # every check passed
EXIT_FINDING = 1  # a check found something: a parity or sampling FAIL, a fuzzer failure, an A/B row slower than allowed
EXIT_USER_ERROR = 2  # what was asked cannot be done here: one line `error: <what is wrong>; <what to do>`
EXIT_INTERNAL_ERROR = 3  # the harness or the engine broke: the traceback is kept


class UserError(Exception):
    """What the user asked for cannot be done here. The message says what is wrong and what to do; python -m harness
    prints it as one line, `error: <message>`, with exit status 2 (-v adds the traceback)."""


def check_device(device: str, flashinfer: bool = False) -> None:
    """Refuse a --device this machine cannot run, before any work starts; `flashinfer`: the verb's CUDA run proves
    or measures FlashInfer's kernels, so it needs flashinfer-python installed."""
    import torch

    from engine.utils.device import has_flashinfer

    try:
        dev = torch.device(device)
    except RuntimeError:
        raise UserError(f"--device {device!r} is not a device; use cpu or cuda[:N]") from None
    if dev.type not in ("cpu", "cuda"):
        raise UserError(f"--device {device}: the engine runs on cpu or cuda[:N] only; use one of them")
    if dev.type != "cuda":
        return
    if not torch.cuda.is_available():
        why = "this torch is built without CUDA" if torch.version.cuda is None else "torch sees no GPU"
        raise UserError(f"--device {device}: CUDA is not available ({why}); use --device cpu, or run on a machine "
                        "with an NVIDIA GPU and a CUDA build of torch")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise UserError(f"--device {device}: this machine has {torch.cuda.device_count()} GPU(s); use cuda:0 to "
                        f"cuda:{torch.cuda.device_count() - 1}")
    if flashinfer and not has_flashinfer():
        raise UserError("FlashInfer is not installed, and the CUDA run is about its kernels; install "
                        "flashinfer-python, or use --device cpu")
