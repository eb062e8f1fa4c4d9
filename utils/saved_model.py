"""A trained model back from the files of any step of the course, in one process, for writing
text (tools/generate.py) and for export (tools/export_hf.py).

The steps save their models in four ways, and all of them load here into one plain
TransformerLM on the CPU or one GPU:
- one ordinary state_dict file, final_model.pt and best_model.pt: save0 (DDP, the performance
  step) and save_full_model (FSDP, the memory step, TP);
- a Distributed Checkpoint folder by save_sharded_model, checkpoints/last and checkpoints/best
  (FSDP), with the optimizer and train_state.json, written by any number of ranks;
- a Distributed Checkpoint folder of the model alone, final_model/ and best_model/ (the
  pipeline and the capstone: every rank writes its part through atomic_folder);
- Lightning's .ckpt: checkpoints/last.ckpt, the best one, hpc_ckpt_N.ckpt.
Every one is checked before it is read (the checksums torch.save and atomic_folder wrote), so a
damaged or incomplete file ends with one line (CheckpointError), not a traceback.

The model's shape comes from the checkpoint itself where it carries it (train_state.json,
Lightning's hyper-parameters), else from the run's summary.json; its words from the run's
vocab.txt (the training scripts write it next to summary.json) or, for a run without one, from
the run's data as summary.json names it.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from model import ModelConfig, TransformerLM
from utils.checkpointing import (MANIFEST, TRAIN_STATE_FILE, CheckpointError, checkpoint_damage,
                                 checkpoint_problem, load_sharded_model, read_train_state,
                                 sealed_folder_problem)
from utils.data import VOCAB_FILE, DataUnavailableError, load_corpus, read_vocab
from utils.files import torch_file_problem

# What a run folder holds, in the order we take it: its final model (the one whose perplexity
# summary.json reports; Lightning tests its last checkpoint), else its best, else the last
# checkpoint of a run that has not finished.
RUN_MODELS = ("final_model.pt", "final_model", "checkpoints/last.ckpt", "best_model.pt",
              "best_model", "checkpoints/best", "checkpoints/last")


@dataclass
class TrainedModel:
    model: TransformerLM  # in eval mode, on the device asked for
    vocab: list[str]      # the data's words: id i is vocab[i]
    checkpoint: Path      # the file or folder the weights came from
    summary: dict         # the run's summary.json ({} where there is none)

    @property
    def words(self) -> int:
        """How many of the model's ids are words. The performance step pads the model's
        vocabulary (--pad-vocab) beyond the data's: the ids from here on are no word."""
        return len(self.vocab)


def load_trained_model(path: str | os.PathLike, device: str | torch.device = "cpu") -> TrainedModel:
    """The model in `path` (a run's --out-dir or one of its saved models, any format), with the
    run's vocabulary. One line (CheckpointError) for anything that stops it."""
    checkpoint = find_checkpoint(Path(path))
    stop_if_damaged(checkpoint)
    run_dir = run_folder(checkpoint)
    summary = json.loads((run_dir / "summary.json").read_text()) \
        if (run_dir / "summary.json").is_file() else {}
    cfg = model_config(checkpoint, summary)
    with torch.device("meta"):  # no time spent drawing random weights
        model = TransformerLM(cfg)
    model.to_empty(device="cpu")
    load_weights(model, checkpoint, cfg)
    vocab = run_vocab(run_dir, summary, cfg)
    return TrainedModel(model.to(device).eval(), vocab, checkpoint, summary)


# ---------------------------------------------------------------------------------------------
# Which file, and of which run

def find_checkpoint(path: Path) -> Path:
    """`path` itself if it is a saved model, else the first of RUN_MODELS in the run folder."""
    if not path.exists():
        raise CheckpointError(f"there is no {path}: give a run's --out-dir or one of its models "
                              f"({', '.join(RUN_MODELS)})")
    if path.is_file() or (path / MANIFEST).is_file() or (path / ".metadata").is_file():
        return path
    found = next((path / name for name in RUN_MODELS if (path / name).exists()), None)
    if found is None:
        raise CheckpointError(f"{path} holds no saved model ({', '.join(RUN_MODELS)}): give the "
                              "--out-dir of a run that finished, or one of its checkpoints")
    return found


def run_folder(checkpoint: Path) -> Path:
    """The --out-dir that wrote `checkpoint`: its folder, or the one above checkpoints/."""
    for folder in (checkpoint.parent, checkpoint.parent.parent):
        if (folder / "summary.json").is_file() or (folder / VOCAB_FILE).is_file():
            return folder
    return checkpoint.parent


def is_sharded_checkpoint(checkpoint: Path) -> bool:
    """A folder by save_sharded_model (FSDP's checkpoints), rather than of the model alone."""
    return checkpoint.is_dir() and (checkpoint / TRAIN_STATE_FILE).is_file()


def model_config(checkpoint: Path, summary: dict) -> ModelConfig:
    """The shape of the model: the checkpoint's own record of it, else summary.json's."""
    saved = None
    if is_sharded_checkpoint(checkpoint):
        saved = read_train_state(checkpoint).get("model_config")
    elif checkpoint.suffix == ".ckpt":
        saved = _read_torch_file(checkpoint).get("hyper_parameters", {}).get("model_config")
    saved = saved or summary.get("model_config")
    if saved is None:
        raise CheckpointError(f"no summary.json next to {checkpoint}, so the model's shape is "
                              "unknown: give the run's --out-dir, with its summary.json")
    return ModelConfig(**saved)


def run_vocab(run_dir: Path, summary: dict, cfg: ModelConfig) -> list[str]:
    """The run's words: its vocab.txt, else its data read again (runs from before vocab.txt)."""
    if (run_dir / VOCAB_FILE).is_file():
        vocab, source = read_vocab(run_dir / VOCAB_FILE), run_dir / VOCAB_FILE
    elif "args" in summary:
        args = summary["args"]
        try:
            vocab = load_corpus(args["dataset"], args.get("data_dir"), args.get("cache_dir"),
                                max_vocab=args.get("max_vocab")).vocab
        except DataUnavailableError as e:
            raise CheckpointError(f"{run_dir} has no {VOCAB_FILE} and its data cannot be read "
                                  f"here ({e})") from None
        source = f"the data of {run_dir / 'summary.json'} ({summary.get('data')})"
    else:
        raise CheckpointError(f"{run_dir} has neither {VOCAB_FILE} nor summary.json, so the "
                              "model's words are unknown: give the run's --out-dir")
    expected = summary.get("data_vocab_size", len(vocab))
    if len(vocab) != expected or len(vocab) > cfg.vocab_size:
        raise CheckpointError(f"{source} has {len(vocab)} words, but the run trained on "
                              f"{expected} with a model of {cfg.vocab_size} ids: it belongs to "
                              "another run")
    return vocab


# ---------------------------------------------------------------------------------------------
# The weights, from each format

def stop_if_damaged(checkpoint: Path) -> None:
    """One line (CheckpointError) if `checkpoint` is incomplete or its contents differ from what
    was written: the checksums of torch.save's records, or of atomic_folder's manifest."""
    if checkpoint.is_dir():
        problem = (checkpoint_problem(checkpoint) if is_sharded_checkpoint(checkpoint)
                   else sealed_folder_problem(checkpoint)) or checkpoint_damage(checkpoint)
    else:
        problem = torch_file_problem(checkpoint)
    if problem:
        raise CheckpointError(f"{checkpoint} cannot be loaded: {problem}; {_instead(checkpoint)}")


def load_weights(model: TransformerLM, checkpoint: Path, cfg: ModelConfig) -> None:
    """Copy the weights saved in `checkpoint` (checked by stop_if_damaged), in any of the
    course's formats, into `model` (a plain TransformerLM on the CPU)."""
    if checkpoint.is_dir():
        # DCP, in a single process, reads from every rank's files the pieces of each tensor
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            if is_sharded_checkpoint(checkpoint):  # under "app.model." (utils/checkpointing.py)
                load_sharded_model(model, None, checkpoint, cfg.to_dict())
            else:
                _load_model_folder(model, checkpoint)
        return
    state = _read_torch_file(checkpoint)
    if "state_dict" in state:  # Lightning's: the LightningModule's, the network under "model."
        state = {k.removeprefix("model."): v for k, v in state["state_dict"].items()}
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        first = next((line.strip() for line in str(e).splitlines()[1:] if line.strip()), str(e))
        raise CheckpointError(f"{checkpoint} does not hold the model of its run's summary.json "
                              f"({first[:300]}): it belongs to another run") from None


def _read_torch_file(path: Path) -> dict:
    """torch.load of a .pt or .ckpt file (mmap: a tensor is read only when used)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - pickled objects, not a state_dict
        raise CheckpointError(f"{path} cannot be loaded as weights ({type(e).__name__}): give a "
                              "model saved by the course") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds no state_dict: give a model saved by the course")
    return state


def _load_model_folder(model: TransformerLM, folder: Path) -> None:
    """dcp.load of the pipeline's and the capstone's folders: the model's own keys."""
    try:
        dcp.load(model.state_dict(), checkpoint_id=folder)
    except (CheckpointException, RuntimeError, ValueError) as e:
        failure = next(iter(e.failures.values())) if isinstance(e, CheckpointException) else e
        failure = failure[0] if isinstance(failure, tuple) else failure
        raise CheckpointError(f"{folder} cannot be loaded: {type(failure).__name__}: "
                              f"{str(failure).splitlines()[0][:300]}") from None


def _instead(checkpoint: Path) -> str:
    """What to load instead of a damaged `checkpoint`: another model of its run, if any."""
    run_dir = run_folder(checkpoint)
    others = [run_dir / name for name in RUN_MODELS
              if (run_dir / name).exists() and run_dir / name != checkpoint]
    return f"load {others[0]} instead" if others else "train the run again"
