"""Train the MNIST feature net used for FID and precision/recall, and save its weights; or
measure what AMP does to a classifier, the table AMP tutorials show.

    python scripts/train_feature_net.py                       # the committed weights
    python scripts/train_feature_net.py --amp --out net.npz   # trained under AMP, kept elsewhere
    python scripts/train_feature_net.py --precisions fp32 amp --table-out feature_net_amp.md

The only place the net exists in PyTorch: common/feature_net.py runs the same forward pass in
numpy from the saved arrays (so that scoring a run imports no framework), and
tests/test_feature_net.py checks that the two agree.

Reproducible: fixed seed, deterministic algorithms, CPU, one thread. Trains on the 60,000
MNIST training images (the embedded copy), reports accuracy on all 10,000 test images, and
writes common/assets/mnist_feature_net.npz (plain float32 arrays) atomically. Exits with status
1 and keeps any existing weights if test accuracy is below 99% (on all 10,000 test images,
whatever --test-limit). Only that run, with its default
flags, writes the committed weights: under --amp, --data-limit, --test-limit, a non-CPU --device,
--result-json, or another --epochs, --batch-size, --lr, --seed or --tf32 the weights are written
only to an explicit --out (same 99% gate).

--amp trains under torch.autocast (bfloat16 on CPU, float16 with a GradScaler on CUDA, or
--amp-dtype), and the test accuracy is measured under the same autocast. Each epoch prints its
training time (the training loop only, not the test pass) and the run ends with the median
s/epoch and the peak memory: the process's peak resident set on a CPU (data and libraries
included), torch.cuda.max_memory_allocated on a GPU. --precisions runs each precision in a
fresh process (the resident set is per process) and prints the markdown table.
"""
from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's code, whatever is installed

import numpy as np
import torch
from torch import nn

from common import cpu, flags
from common import data as datasets
from common.config import RunConfig, learning_rate
from common.errors import Interrupted, UsageError, UserError, exit_on_user_error, run_child
from common.feature_net import DEFAULT_WEIGHTS, FEATURE_DIM, NUM_CLASSES, to_network_input
from common.pytorch import runtime as torch_runtime
from common.runs import atomic_write, refuse_inside_a_run, text_bytes
from scripts.benchmark import PRECISION_FLAGS

MIN_TEST_ACCURACY = 0.99  # on all MNIST_TEST_IMAGES, whatever --test-limit: the gate for writing weights
MNIST_TEST_IMAGES = 10_000
TABLE_PRECISIONS = {"amp": ["--amp"], **PRECISION_FLAGS}  # amp: --amp's own choice for the device


class MnistFeatureNet(nn.Module):
    """LeNet-style classifier: two 5x5 conv + max-pool blocks, a 128-unit ReLU layer (the
    features), and a linear layer to 10 class logits. Its state_dict names and shapes are the
    weights file's format (common.feature_net.WEIGHT_SHAPES); change both together."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, kernel_size=5)  # 28 -> 24, pooled to 12
        self.conv2 = nn.Conv2d(32, 64, kernel_size=5)  # 12 -> 8, pooled to 4
        self.fc1 = nn.Linear(64 * 4 * 4, FEATURE_DIM)
        self.fc2 = nn.Linear(FEATURE_DIM, NUM_CLASSES)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """(N, 1, 28, 28) in [0, 1] -> (N, 128) post-ReLU activations of the feature layer."""
        x = nn.functional.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = nn.functional.max_pool2d(torch.relu(self.conv2(x)), 2)
        return torch.relu(self.fc1(x.flatten(1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.features(x))


def network_input_tensor(images: np.ndarray) -> torch.Tensor:
    """NHWC uint8 or [0, 1] float images -> float32 NCHW tensor in [0, 1], with the numpy net's
    own conversion and checks (common.feature_net.to_network_input), so both see the same pixels."""
    return torch.from_numpy(np.ascontiguousarray(to_network_input(images).transpose(0, 3, 1, 2)))  # NHWC -> NCHW


def state_to_arrays(net: MnistFeatureNet) -> dict[str, np.ndarray]:
    """The weights as plain float32 arrays, the format of the committed .npz file."""
    return {name: tensor.detach().cpu().numpy().astype(np.float32) for name, tensor in net.state_dict().items()}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = flags.OneLineErrorParser(description=flags.first_paragraph(__doc__))
    parser.add_argument("--epochs", type=flags.positive_int, default=4)
    parser.add_argument("--batch-size", type=flags.positive_int, default=128)
    parser.add_argument("--lr", type=learning_rate, default=1e-3,
                        help="Adam learning rate; divided by 10 for the last epoch")
    parser.add_argument("--seed", type=flags.seed, default=0, help="0 to 2**32 - 1")
    parser.add_argument("--amp", action="store_true",
                        help="automatic mixed precision: bfloat16 on CPU, float16 + loss scaling on CUDA")
    parser.add_argument("--amp-dtype", choices=("auto", "float16", "bfloat16"), default="auto",
                        help="override the AMP compute dtype (needs --amp)")
    parser.add_argument("--tf32", choices=("auto", "on", "off"),  # None: not given (auto)
                        help="CUDA float32 matmuls and convolutions in TensorFloat-32, as the model "
                             "scripts' --tf32 (auto: PyTorch's default); no effect on a CPU")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="cpu",
                        help="default cpu: the committed weights are the CPU run's, bit for bit")
    parser.add_argument("--data-limit", type=flags.positive_int, help="train on the first N training images only")
    parser.add_argument("--test-limit", type=flags.positive_int,
                        help="test on the first N test images (default: all; --data-limit / 6 with --data-limit)")
    parser.add_argument("--out", type=flags.output_file,
                        help="where to write the weights (default: common/assets/mnist_feature_net.npz "
                             "from the reproducible run only, nowhere otherwise)")
    parser.add_argument("--result-json", type=flags.output_file,
                        help="also write the run's measurements to this JSON file")
    parser.add_argument("--precisions", nargs="+", choices=tuple(TABLE_PRECISIONS),
                        help="train once per precision, each in a fresh process, and print the markdown table")
    parser.add_argument("--table-out", type=flags.output_file,
                        help="with --precisions: also write the table to this file")
    parser.add_argument("--table-row", action="store_true", help=argparse.SUPPRESS)  # run by --precisions
    args = parser.parse_args(argv)
    if args.amp_dtype != "auto" and not args.amp:
        raise UsageError(f"--amp-dtype {args.amp_dtype} needs --amp")
    if args.precisions:
        if problem := flags.repeated_values_problem("--precisions", args.precisions):
            raise UsageError(problem)
        runs_as = {}  # the precision each name runs in here: amp and amp-bf16 are one on a CPU
        for name in args.precisions:
            runs_as.setdefault(precision_run(name, args.device), []).append(name)
        if same := next(((run, names) for run, names in runs_as.items() if len(names) > 1), None):
            raise UsageError(f"--precisions {' and '.join(same[1])} are one precision here ({same[0]}): "
                             "it would be measured and tabled twice")
        clashing = [flag for flag, value in (("--amp", args.amp), ("--tf32", args.tf32 is not None),
                                             ("--out", args.out), ("--result-json", args.result_json)) if value]
        if clashing:
            raise UsageError(f"--precisions sets the precision of each run and keeps no weights: "
                             f"drop {', '.join(clashing)}")
    elif args.table_out:
        raise UsageError("--table-out needs --precisions")
    args.tf32 = args.tf32 or "auto"
    for flag, path in (("--out", args.out), ("--result-json", args.result_json), ("--table-out", args.table_out)):
        if path:
            refuse_inside_a_run(path, flag)
    weights = [path.resolve() for path in (args.out, DEFAULT_WEIGHTS) if path]
    for flag, path in (("--result-json", args.result_json), ("--table-out", args.table_out)):
        # Written whatever the accuracy gate decides, so it would replace the weights it names
        if path and path.resolve() in weights:
            raise UsageError(f"{flag} {path} is a weights file; name another file")
    return args


# The flags of the run whose weights are committed: every FID depends on them
REPRODUCIBLE_RUN = ("epochs", "batch_size", "lr", "seed", "amp", "amp_dtype", "tf32", "device", "data_limit",
                    "test_limit", "result_json")


def weights_destination(args: argparse.Namespace) -> Path | None:
    """--out if given; else the committed weights, from the reproducible run only (float32, CPU,
    all the data, the default epochs, batch size, rate and seed), so that no other run silently
    replaces them."""
    if args.out:
        return args.out
    defaults = parse_args([])
    if any(getattr(args, name) != getattr(defaults, name) for name in REPRODUCIBLE_RUN):
        return None
    return DEFAULT_WEIGHTS


def accuracy(net: MnistFeatureNet, inputs: torch.Tensor, labels: torch.Tensor, runtime: torch_runtime.Runtime,
             batch_size: int = 1000) -> float:
    """Test accuracy under the training run's autocast (float32 without --amp)."""
    net.eval()
    correct = torch.zeros((), dtype=torch.int64, device=inputs.device)
    dtype = runtime.compute_dtype
    with torch.no_grad(), torch.autocast(runtime.device.type, dtype=dtype, enabled=dtype is not None):
        for start in range(0, len(inputs), batch_size):
            logits = net(inputs[start:start + batch_size])
            correct += (logits.argmax(dim=1) == labels[start:start + batch_size]).sum()
    return correct.item() / len(inputs)


def train(args: argparse.Namespace) -> tuple[MnistFeatureNet, dict]:
    """The trained net and the run's measurements (precision, s/epoch, peak memory, test accuracy)."""
    runtime = torch_runtime.setup(RunConfig(model="mnist_feature_net", framework="pytorch", amp=args.amp,
                                            amp_dtype=args.amp_dtype, tf32=args.tf32, device=args.device,
                                            seed=args.seed))
    device, dtype, scaler = runtime.device, runtime.compute_dtype, runtime.scaler
    order_rng = np.random.default_rng(args.seed)
    test_limit = args.test_limit or (max(1, args.data_limit // 6) if args.data_limit else None)
    train_set = datasets.load_dataset("mnist", split="train", limit=args.data_limit)
    test_set = datasets.load_dataset("mnist", split="test", limit=test_limit)
    inputs, labels = network_input_tensor(train_set.x).to(device), torch.from_numpy(train_set.y).to(device)
    test_inputs, test_labels = network_input_tensor(test_set.x).to(device), torch.from_numpy(test_set.y).to(device)
    net = runtime.place(MnistFeatureNet())
    optimizer = torch.optim.Adam(net.parameters(), lr=args.lr)
    epoch_seconds = []
    for epoch in range(args.epochs):
        if epoch == args.epochs - 1 and args.epochs > 1:
            for group in optimizer.param_groups:  # a short low-rate epoch settles the weights
                group["lr"] = args.lr / 10
        net.train()
        order = torch.from_numpy(order_rng.permutation(len(inputs))).to(device)
        total_loss = torch.zeros((), dtype=torch.float64, device=device)  # read once per epoch
        started = time.perf_counter()
        for start in range(0, len(order), args.batch_size):
            batch = order[start:start + args.batch_size]
            # The AMP training step as the PyTorch docs write it. Under bfloat16 the scaler is
            # disabled and its three calls are plain backward(), optimizer.step() and nothing.
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                logits = net(inputs[batch])
            loss = nn.functional.cross_entropy(logits.float(), labels[batch])  # the loss in float32
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            total_loss += loss.detach().double() * len(batch)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the GPU's work, not just its queueing
        epoch_seconds.append(time.perf_counter() - started)
        test_accuracy = accuracy(net, test_inputs, test_labels, runtime)
        print(f"epoch {epoch + 1}/{args.epochs}: {epoch_seconds[-1]:.2f} s, train loss "
              f"{total_loss.item() / len(order):.4f}, test accuracy {test_accuracy:.4f}", flush=True)
    gate_accuracy = None  # of the gate that admits weights, on every test image (none: no weights to write)
    if weights_destination(args) is not None:
        gate_accuracy = test_accuracy
        if test_limit is not None:  # one image right of a net 22% accurate passed the gate
            full = datasets.load_dataset("mnist", split="test")
            gate_accuracy = accuracy(net, network_input_tensor(full.x).to(device),
                                     torch.from_numpy(full.y).to(device), runtime)
    machine = (torch.cuda.get_device_name(device) if device.type == "cuda"
               else f"{cpu.summary()}, {torch.get_num_threads()} thread(s)")
    return net, {"precision": runtime.precision, "tf32": args.tf32 if device.type == "cuda" else "-",
                 "device": device.type, "machine": machine,
                 "torch": torch.__version__, "epochs": args.epochs, "batch_size": args.batch_size,
                 "train_images": len(inputs), "test_images": len(test_inputs), "epoch_seconds": epoch_seconds,
                 "median_epoch_s": statistics.median(epoch_seconds), "peak_memory_mb": runtime.peak_memory_mb(),
                 "test_accuracy": test_accuracy, "gate_accuracy": gate_accuracy}


def markdown(results: list[dict]) -> str:
    """The side-by-side table, and under it what it was measured on."""
    lines = ["| precision | median s/epoch | peak memory MB | test accuracy |", "|---|---|---|---|"]
    label = lambda r: r["precision"] + (f", TF32 {r['tf32']}" if r.get("tf32", "-") != "-" else "")  # GPU rows
    lines += [f"| {label(r)} | {r['median_epoch_s']:.2f} | {r['peak_memory_mb']:.0f} | {r['test_accuracy']:.4f} |"
              for r in results]
    first = results[0]
    memory = ("torch.cuda.max_memory_allocated" if first["device"] == "cuda"
              else "the process's peak resident set (data and libraries included)")
    epochs = f"{first['epochs']} epoch{'s' * (first['epochs'] != 1)}"
    lines += ["", f"MNIST feature net, {epochs} on {first['train_images']:,} images "
                  f"(batch {first['batch_size']}), test accuracy on {first['test_images']:,} images under "
                  f"the run's autocast; {first['device']}: {first['machine']}; torch {first['torch']}; "
                  f"peak memory: {memory}; each precision in a fresh process."]
    return "\n".join(lines)


def on_gpu(device: str) -> bool:
    return device == "cuda" or (device == "auto" and torch.cuda.is_available())


def precision_run(precision: str, device: str) -> str:
    """The precision a --precisions name runs in on this device: amp is bfloat16 on a CPU,
    float16 on a GPU; TensorFloat-32 exists on a GPU only."""
    if precision == "amp":
        return "amp-fp16" if on_gpu(device) else "amp-bf16"
    return "fp32" if precision == "fp32-tf32" and not on_gpu(device) else precision


def table_flags(precision: str, device: str) -> list[str]:
    """A row's precision flags; --tf32 only where a GPU computes (a CPU run noted it as
    ignored, a flag the user never gave)."""
    row = TABLE_PRECISIONS[precision]
    if on_gpu(device) or "--tf32" not in row:
        return row
    at = row.index("--tf32")
    return row[:at] + row[at + 2:]


def run_precisions(args: argparse.Namespace) -> str:
    """Each precision in a fresh process (peak memory is per process), then the table."""
    shared = ["--epochs", str(args.epochs), "--batch-size", str(args.batch_size), "--lr", str(args.lr),
              "--seed", str(args.seed), "--device", args.device]
    for flag, value in (("--data-limit", args.data_limit), ("--test-limit", args.test_limit)):
        if value is not None:
            shared += [flag, str(value)]
    results = []
    with tempfile.TemporaryDirectory() as folder:
        for precision in args.precisions:
            result_path = Path(folder) / f"{precision}.json"
            print(f"== {precision}", flush=True)
            status = run_child([sys.executable, __file__, *shared, *table_flags(precision, args.device),
                                f"--result-json={result_path}", "--table-row"],
                               f"the table stopped at {precision}").returncode
            if status != 0:
                raise UserError(f"the {precision} run failed (exit {status}); its error is above")
            results.append(json.loads(result_path.read_text()))
    return markdown(results)


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.precisions:
        table = run_precisions(args)
        print(table)
        if args.table_out:
            args.table_out.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(args.table_out, lambda file: file.write(text_bytes(table + "\n")))
            print(f"wrote {args.table_out}")
        return
    torch.set_num_threads(1)  # reproducible, and leaves the other cores to whatever else runs
    try:
        net, result = train(args)
    except KeyboardInterrupt:
        if not args.table_row:
            raise
        raise Interrupted("", quiet=True) from None  # the --precisions parent says the one line
    print(f"{result['precision']}: median {result['median_epoch_s']:.2f} s/epoch, peak memory "
          f"{result['peak_memory_mb']:.0f} MB, test accuracy {result['test_accuracy']:.4f} on "
          f"{result['test_images']:,} MNIST test images")
    if args.result_json:
        args.result_json.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(args.result_json, lambda file: file.write(json.dumps(result, indent=2).encode()))
    destination = weights_destination(args)
    if destination is None and args.table_row:  # --precisions keeps no weights
        return
    if destination is None:
        print(f"weights not written: only the reproducible run (its default flags: float32, CPU, all the data) "
              f"replaces {DEFAULT_WEIGHTS.name}; pass --out PATH to keep these")
        return
    if result["gate_accuracy"] < MIN_TEST_ACCURACY:
        raise UserError(f"test accuracy {result['gate_accuracy']:.4f} on all {MNIST_TEST_IMAGES:,} test images is "
                        f"below {MIN_TEST_ACCURACY}; weights not saved, train longer with --epochs")
    buffer = io.BytesIO()
    np.savez(buffer, **state_to_arrays(net), meta_test_accuracy=np.float64(result["gate_accuracy"]))
    destination.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(destination, lambda file: file.write(buffer.getvalue()))
    print(f"wrote {destination}")


if __name__ == "__main__":
    sys.exit(main())
