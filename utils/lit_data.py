"""A LightningDataModule over the course's data code: the same corpus, cache and windows as the
plain scripts. Only the Lightning variant imports this file (utils/__init__ does not)."""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from utils.data import Corpus, DistributedEvalSampler, TokenWindows


class WikiText2DataModule(L.LightningDataModule):
    """Training, validation and test loaders, sharded over the data-parallel ranks exactly as in
    the DDP lesson (TODO 3). Use it with `Trainer(use_distributed_sampler=False)`.

    Lightning could insert samplers itself, but its DistributedSampler pads the validation and
    test splits by repeating samples (counted twice in the loss) and pads the training split
    instead of dropping the remainder. So we give the samplers; Lightning still calls set_epoch.
    """

    def __init__(self, corpus: Corpus, seq_len: int, batch_size: int, num_workers: int = 0,
                 seed: int = 0):
        super().__init__()
        self.batch_size, self.num_workers, self.seed = batch_size, num_workers, seed
        self.train_ds, self.val_ds, self.test_ds = (
            TokenWindows(tokens, seq_len) for tokens in (corpus.train, corpus.valid, corpus.test))

    def _shard(self) -> dict:
        """num_replicas and rank among the data-parallel ranks (the world under DDP; the
        "data_parallel" dimension of the device mesh under ModelParallelStrategy)."""
        kwargs = self.trainer.distributed_sampler_kwargs if self.trainer is not None else None
        return kwargs or {"num_replicas": 1, "rank": 0}

    def _loader(self, dataset, sampler, **kwargs) -> DataLoader:
        return DataLoader(dataset, sampler=sampler, batch_size=self.batch_size,
                          num_workers=self.num_workers, pin_memory=torch.cuda.is_available(),
                          **kwargs)

    def train_dataloader(self) -> DataLoader:
        sampler = DistributedSampler(self.train_ds, shuffle=True, seed=self.seed, drop_last=True,
                                     **self._shard())
        return self._loader(self.train_ds, sampler, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_ds, DistributedEvalSampler(self.val_ds, **self._shard()))

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_ds, DistributedEvalSampler(self.test_ds, **self._shard()))
