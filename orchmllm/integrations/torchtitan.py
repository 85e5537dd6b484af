"""torchtitan's data loader component, balanced by orchmllm (``pip install --no-deps torchtitan``).

torchtitan's trainer builds its loader from the job config (``config.dataloader.build(
dp_world_size=, dp_rank=, tokenizer=, seq_len=, local_batch_size=, ...)``), iterates
``(input_dict, labels)`` pairs and checkpoints the loader through ``state_dict`` per data-parallel
rank. :class:`BalancedTitanLoader` is such a component: its ``Config`` takes the place of the
trainer's ``dataloader`` config, and it yields, per step, this rank's balanced share of the step's
documents packed into one row (``input_dict["input"]`` and ``labels``, each ``[1, tokens]``,
``labels`` the next tokens of each document: torchtitan's own convention, so its
``post_dataloading_process`` and document masking apply unchanged).

Each step holds at most ``local_batch_size * seq_len`` tokens per rank (``BalancedDataLoader``'s
``max_tokens_per_rank``): the epoch is packed into steps whose ranks carry near-equal tokens,
instead of fixed windows cut across documents. torchtitan already divides each rank's summed
loss by the global count of valid tokens, so the gradients are those of the same documents on
any rank.

The documents come from ``dataset_path``: an HF ``datasets`` folder (``save_to_disk``) with an
``input_ids`` column (tokenised documents; longer ones are cut to ``seq_len + 1`` tokens), or a
``text`` column, which the trainer's tokenizer encodes with BOS and EOS.

Recipe (torchtitan's trainer needs a GPU: its model registries import triton): a config module
of your own replaces the ``dataloader`` of one of torchtitan's configs::

    # my_configs.py
    from torchtitan.models.llama3.config_registry import llama3_8b
    from orchmllm.integrations.torchtitan import BalancedTitanLoader

    def llama3_8b_balanced():
        config = llama3_8b()
        config.dataloader = BalancedTitanLoader.Config(dataset_path="/data/docs")
        return config

    torchrun --nproc_per_node=8 -m torchtitan.train --module my_configs --config llama3_8b_balanced

Pick a document-masking attention (``attn_backend="varlen"`` or flex ``block_causal``) so that
packed documents do not attend to each other. Balancing is over the data-parallel ranks only.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import datasets
import numpy as np
import pyarrow.compute as pc
import torch
from torchtitan.components.dataloader import BaseDataLoader

import orchmllm


def _pack(
    examples: Sequence[dict], *, max_len: int
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Documents as one row: each contributes its first ``max_len`` tokens but the last as
    input and the same tokens but the first as labels."""
    docs = [torch.as_tensor(e["input_ids"][:max_len], dtype=torch.long) for e in examples]
    empty = torch.zeros(0, dtype=torch.long)
    inputs = torch.cat([empty, *(d[:-1] for d in docs)])
    labels = torch.cat([empty, *(d[1:] for d in docs)])
    return {"input": inputs[None]}, labels[None]


class BalancedTitanLoader(BaseDataLoader):
    """torchtitan's dataloader component: documents balanced over the data-parallel ranks.

    Args:
        config: the :class:`Config` (the trainer's ``dataloader`` section).
        dp_world_size, dp_rank: this rank's place in the data-parallel group (torchtitan's
            batch mesh; the loader itself gathers over the default process group, which must
            be that group: data parallelism only).
        tokenizer: the trainer's tokenizer (encodes a ``text`` column).
        seq_len, local_batch_size: each rank's step budget is their product in tokens.
        dataset: a map-style dataset of ``{"input_ids"}`` instead of ``dataset_path``
            (programmatic use and tests).
        kwargs: the trainer's other build arguments (``snapshot_every_n_steps``), unused.

    Raises:
        ValueError: neither ``dataset`` nor ``config.dataset_path``, a dataset without
            ``input_ids`` or ``text``, ``dp_world_size`` unlike the process group's size.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        policy: str = "greedy"
        """The balancing policy (``orchmllm.POLICIES``)."""

        seed: int = 0
        """The shuffling seed (the same on every rank)."""

        infinite: bool = True
        """Start the next epoch when one ends (torchtitan trains by steps)."""

        num_workers: int = 0
        """DataLoader workers that load each rank's documents."""

        plugins: list[str] = field(default_factory=list)
        """Module names or ``.py`` paths imported (on every rank) before the loader is built:
        where a policy of one's own is registered (:mod:`orchmllm.plugins`)."""

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        tokenizer: Any = None,
        seq_len: int,
        local_batch_size: int,
        dataset: Any = None,
        **kwargs: Any,
    ) -> None:
        orchmllm.load_plugins(config.plugins)
        self.config, self.dp_rank, self.dp_world_size = config, dp_rank, dp_world_size
        self.seq_len = seq_len
        documents = self._documents(config, dataset, tokenizer)
        cut = seq_len + 1  # a document predicts at most seq_len tokens, as in torchtitan
        sizes = pc.list_value_length(documents.with_format("arrow")["input_ids"])
        lengths = np.clip(sizes.to_numpy(zero_copy_only=False), 1, cut) - 1  # predicted tokens
        self.loader = orchmllm.BalancedDataLoader(
            documents,
            max_tokens_per_rank=seq_len * local_batch_size,
            lengths=lengths,
            collate_fn=functools.partial(_pack, max_len=cut),
            sampling=orchmllm.SamplingOptions(seed=config.seed, num_replicas=dp_world_size),
            planning=orchmllm.PlanningOptions(policy=config.policy),
            options=orchmllm.LoaderOptions(num_workers=config.num_workers),
        )

    def _documents(self, config: Config, dataset: Any, tokenizer: Any) -> Any:
        if dataset is None:
            if not config.dataset_path:
                raise ValueError("pass dataset= or set the config's dataset_path")
            dataset = datasets.load_from_disk(config.dataset_path)
        columns = getattr(dataset, "column_names", None) or list(dataset[0])
        if "input_ids" not in columns:
            if "text" not in columns or tokenizer is None:
                raise ValueError(
                    f"the dataset needs an input_ids column (or text and a tokenizer); "
                    f"it has {columns}"
                )
            encode = lambda e: {  # noqa: E731
                "input_ids": tokenizer.encode(e["text"], add_bos=True, add_eos=True)
            }
            dataset = dataset.map(encode, remove_columns=columns)
        if not isinstance(dataset, datasets.Dataset):
            rows = [list(dataset[i]["input_ids"]) for i in range(len(dataset))]
            dataset = datasets.Dataset.from_dict({"input_ids": rows})
        return dataset.select_columns(["input_ids"]).with_format("torch")

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            yield from self.loader
            if not self.config.infinite:
                return
            self.loader.set_epoch(self.loader.epoch + 1)

    def state_dict(self) -> dict[str, Any]:
        """This rank's position (epoch and steps consumed), keyed by its data-parallel rank as
        torchtitan's own loader keys it."""
        return {
            f"dp_rank_{self.dp_rank}": self.loader.state_dict(),
            "world_size": self.dp_world_size,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` (an empty one: start afresh).

        Raises:
            ValueError: a state saved with another data-parallel size.
        """
        if not state_dict:
            return
        if state_dict["world_size"] != self.dp_world_size:
            raise ValueError(
                f"the state was saved with dp_world_size={state_dict['world_size']}, "
                f"this loader has {self.dp_world_size}"
            )
        self.loader.load_state_dict(state_dict[f"dp_rank_{self.dp_rank}"])
