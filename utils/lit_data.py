"""A LightningDataModule over the course's data code: the same corpus, cache and windows as the
plain scripts. Only the Lightning variant imports this file (utils/__init__ does not)."""

from __future__ import annotations

import itertools

import lightning as L
import torch
from torch.utils.data import DataLoader, Sampler
from torch.utils.data.distributed import DistributedSampler

from utils.data import Corpus, DistributedEvalSampler, TokenWindows


class SkipFirstBatches(Sampler):
    """The indices of `sampler`, the first time without its first `samples` (a run resumed in
    the middle of an epoch continues with the batch after the last one it trained on). Its
    length stays the whole epoch's: Lightning counts the skipped batches as done. Lightning
    calls set_epoch on it, as on the sampler inside."""

    def __init__(self, sampler: DistributedSampler, samples: int = 0):
        self.sampler, self.samples = sampler, samples

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __iter__(self):
        skip, self.samples = self.samples, 0
        return itertools.islice(iter(self.sampler), skip, None)

    def __len__(self) -> int:
        return len(self.sampler)


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
        # generator: each iterator draws its workers' seed from a generator of its own, not from
        # the global one that dropout draws from (a resumed run continues exactly)
        return DataLoader(dataset, sampler=sampler, batch_size=self.batch_size,
                          num_workers=self.num_workers, pin_memory=torch.cuda.is_available(),
                          generator=torch.Generator(), **kwargs)

    def train_dataloader(self) -> DataLoader:
        sampler = DistributedSampler(self.train_ds, shuffle=True, seed=self.seed, drop_last=True,
                                     **self._shard())
        skip = SkipFirstBatches(sampler, self._batches_done() * self.batch_size)
        return self._loader(self.train_ds, skip, drop_last=True)

    def _batches_done(self) -> int:
        """Batches of the current epoch that a restored checkpoint had trained on already.

        Lightning restores its progress counters before asking for the loader, and counts those
        batches as done, but without a resumable loader it would start the epoch's data again
        from its first batch: a resumed run would train on other batches than the run that
        never stopped. (At the end of an epoch the count is the whole epoch: nothing to skip.)
        """
        if self.trainer is None:
            return 0
        done = self.trainer.fit_loop.epoch_loop.batch_progress.current.processed
        per_epoch = len(self.train_ds) // (self._shard()["num_replicas"] * self.batch_size)
        return done if 0 < done < per_epoch else 0

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_ds, DistributedEvalSampler(self.val_ds, **self._shard()))

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_ds, DistributedEvalSampler(self.test_ds, **self._shard()))
