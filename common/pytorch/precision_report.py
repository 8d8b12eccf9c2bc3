"""--precision-report in PyTorch: the dtype every leaf layer's output really had in one
forward-and-backward of the training step, recorded by forward hooks. The step is then
undone (weights, optimizer moments, the average of G, loss scale, random state), so the run
trains exactly as without the report. common/precision_report.py prints the rows."""
from __future__ import annotations

import copy

import torch

from common.precision_report import LayerRow


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def precision_report(trainer, runtime, batch: torch.Tensor) -> list[LayerRow]:
    rows, hooks = [], []
    for name, module in trainer.modules.items():
        for layer_name, layer in module.named_modules():
            if next(layer.children(), None) is not None:
                continue  # containers: their leaves are reported
            weights = next(layer.parameters(recurse=False), None)
            label = f"{name}.{layer_name}" if layer_name else name

            def record(layer, inputs, output, label=label, weights=weights):
                output = output[0] if isinstance(output, tuple) else output
                rows.append((label, type(layer).__name__,
                             dtype_name(weights.dtype) if weights is not None else "-", dtype_name(output.dtype)))
            hooks.append(layer.register_forward_hook(record))

    saved = {k: {n: t.clone() for n, t in m.state_dict().items()} for k, m in trainer.modules.items()}
    averages = {k: {"module": {n: t.clone() for n, t in a.module.state_dict().items()}, "updates": a.updates}
                for k, a in trainer.averages.items()}  # the probe step moves the average of G too
    # state_dict() hands out the live moment tensors, which the probe step updates in place
    optimizers = {k: copy.deepcopy(o.state_dict()) for k, o in trainer.optimizers.items()}
    scaler, rng = runtime.scaler.state_dict(), torch.get_rng_state()
    cuda = runtime.device.type == "cuda"
    cuda_rng = torch.cuda.get_rng_state(runtime.device) if cuda else None
    try:
        # Eager: hooks see every layer (a compiled graph fuses them).
        with torch.compiler.set_stance("force_eager"):
            trainer.train_step(batch)
    finally:
        for hook in hooks:
            hook.remove()
    for key, module in trainer.modules.items():
        module.load_state_dict(saved[key])
    for key, optimizer in trainer.optimizers.items():
        optimizer.load_state_dict(optimizers[key])
    for key, average in trainer.averages.items():
        average.load_state_dict(averages[key])
    if runtime.scaler.is_enabled():
        runtime.scaler.load_state_dict(scaler)
    torch.set_rng_state(rng)
    if cuda:
        torch.cuda.set_rng_state(cuda_rng, runtime.device)

    seen, unique = set(), []
    for row in rows:  # D runs twice per GAN step (real, fake): one row per layer
        if row[0] not in seen:
            seen.add(row[0])
            unique.append(row)
    return unique
