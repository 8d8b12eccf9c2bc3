"""Run under torchrun by tests/test_distributed.py: a model script's main(), after which every
replica saves its own networks' weights to <--out>/rank<R>.pt (rank 0 alone writes the run
folder, so this is how a test sees the weights of the others).

    torchrun ... tests/replica_probe.py GAN/dcgan/dcgan_pytorch.py [flags]
"""
import importlib.util
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from common import loop  # noqa: E402

script, flags = sys.argv[1], sys.argv[2:]
trained = {}
train = loop.train


def train_and_keep(cfg, run, session, *args, **kwargs):
    summary = train(cfg, run, session, *args, **kwargs)
    trained["modules"] = session.trainer.modules
    return summary


loop.train = train_and_keep
spec = importlib.util.spec_from_file_location("model_script", REPO / script)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
module.main(flags)
out = Path(flags[flags.index("--out") + 1])
torch.save({name: {key: value.detach().cpu() for key, value in network.state_dict().items()}
            for name, network in trained["modules"].items()}, out / f"rank{os.environ['RANK']}.pt")
