"""Train the MNIST feature net used for FID and precision/recall, and save its weights.

    python scripts/train_feature_net.py

The only place the net exists in PyTorch: common/feature_net.py runs the same forward pass in
numpy from the saved arrays (so that scoring a run imports no framework), and
tests/test_feature_net.py checks that the two agree.

Reproducible: fixed seed, deterministic algorithms, CPU, one thread. Trains on the 60,000
MNIST training images (the embedded copy), reports accuracy on all 10,000 test images, and
writes common/assets/mnist_feature_net.npz (plain float32 arrays) atomically. Exits with status
1 and keeps any existing weights if test accuracy is below 99%.
"""
from __future__ import annotations

import argparse
import io
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's code, whatever is installed

import numpy as np
import torch
from torch import nn

from common import data as datasets
from common.errors import UserError, exit_on_user_error
from common.feature_net import DEFAULT_WEIGHTS, FEATURE_DIM, NUM_CLASSES, to_network_input
from common.runs import atomic_write

MIN_TEST_ACCURACY = 0.99


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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate; divided by 10 for the last epoch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=DEFAULT_WEIGHTS)
    args = parser.parse_args(argv)
    if args.epochs < 1 or args.batch_size < 1 or args.lr <= 0:
        parser.error("--epochs and --batch-size must be at least 1 and --lr positive")
    return args


def accuracy(net: MnistFeatureNet, images: np.ndarray, labels: np.ndarray, batch_size: int = 1000) -> float:
    net.eval()
    correct = 0
    with torch.no_grad():
        for start in range(0, len(images), batch_size):
            logits = net(network_input_tensor(images[start:start + batch_size]))
            correct += int((logits.argmax(dim=1).numpy() == labels[start:start + batch_size]).sum())
    return correct / len(images)


def train(args: argparse.Namespace) -> tuple[MnistFeatureNet, float]:
    """The trained net and its test accuracy."""
    torch.manual_seed(args.seed)
    order_rng = np.random.default_rng(args.seed)
    train_set = datasets.load_dataset("mnist", split="train")
    test_set = datasets.load_dataset("mnist", split="test")
    inputs, labels = network_input_tensor(train_set.x), torch.from_numpy(train_set.y)
    net = MnistFeatureNet()
    optimizer = torch.optim.Adam(net.parameters(), lr=args.lr)
    for epoch in range(args.epochs):
        if epoch == args.epochs - 1 and args.epochs > 1:
            for group in optimizer.param_groups:  # a short low-rate epoch settles the weights
                group["lr"] = args.lr / 10
        net.train()
        order = torch.from_numpy(order_rng.permutation(len(inputs)))
        total_loss = 0.0
        for start in range(0, len(order), args.batch_size):
            batch = order[start:start + args.batch_size]
            loss = torch.nn.functional.cross_entropy(net(inputs[batch]), labels[batch])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total_loss += loss.item() * len(batch)
        test_accuracy = accuracy(net, test_set.x, test_set.y)
        print(f"epoch {epoch + 1}/{args.epochs}: train loss {total_loss / len(order):.4f}, "
              f"test accuracy {test_accuracy:.4f}", flush=True)
    return net, test_accuracy


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)  # reproducible, and leaves the other cores to whatever else runs
    torch.use_deterministic_algorithms(True)
    started = time.perf_counter()
    net, test_accuracy = train(args)
    minutes = (time.perf_counter() - started) / 60
    print(f"test accuracy {test_accuracy:.4f} on 10,000 MNIST test images after {minutes:.1f} min")
    if test_accuracy < MIN_TEST_ACCURACY:
        raise UserError(f"test accuracy {test_accuracy:.4f} is below {MIN_TEST_ACCURACY}; weights not saved, "
                        "train longer with --epochs")
    buffer = io.BytesIO()
    np.savez(buffer, **state_to_arrays(net), meta_test_accuracy=np.float64(test_accuracy))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(args.out, lambda file: file.write(buffer.getvalue()))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
