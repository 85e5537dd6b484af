"""Hugging Face vision-language models, balanced by their adapters (``pip install -e ".[hf]"``).

A plain data-parallel script becomes balanced in a few lines::

    from orchmllm.integrations import transformers as omt

    model = omt.shard(omt.wrap(model))   # towers and language model become phases; FSDP2
    loader = model.loader(dataset, batch_size=8, sampling=orchmllm.SamplingOptions(seed=0))
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            loss = model(batch).loss * world_size   # normalised over every rank's targets
            loss.backward()
    omt.save_pretrained(model, "out")   # collective: a plain HF checkpoint (from_pretrained)

In a ``transformers.Trainer``, pass the wrapped model to
``orchmllm.integrations.trainer.BalancedTrainer(model=omt.wrap(model), ...)``: it uses
:meth:`BalancedModel.loader` and the Trainer's own loss normalisation (DDP, no sharding needed).

``dataset`` holds the processor's rows (one example each: ``input_ids`` with placeholders,
``labels``, ``pixel_values``, ...), as a plain ``DataLoader`` would read them. The adapter is
chosen by the model's class (:data:`ADAPTERS`). A family without one needs an :class:`Adapter`
subclass (``tiles.LlavaAdapter`` is about 40 lines): ``sources`` (which placeholder token stands
for which kind of item, in which phase), ``feature_dims``, ``split`` (a row's items: raw rows,
record, tokens), ``encode`` (the tower on packed items, through the model's own feature
functions) and ``dummy``; ``position_ids`` and ``language_kwargs`` where the language model
needs more than restarting 1-D positions. Then ``register_adapter(YourModelClass,
YourAdapter)``.

Modules: :mod:`.adapter` (the base class, the registry, packed positions), :mod:`.balanced`
(:func:`wrap`, :func:`shard`, :class:`BalancedModel`), :mod:`.save` (:func:`save_pretrained`),
:mod:`.qwen` and :mod:`.tiles` (the adapters), :mod:`.lengths` (each example's token counts
from its metadata, by the processor's rules, before anything is decoded), :mod:`.tiny` (tiny
models and processor rows of every family, for tests and the examples).
"""

from orchmllm.integrations.transformers import lengths, qwen, tiles
from orchmllm.integrations.transformers.adapter import (
    ADAPTERS,
    PACKING_ATTENTION,
    TEXT_ROPE,
    Adapter,
    Item,
    Source,
    adapter_for,
    item_rope,
    mrope_positions,
    register_adapter,
    restart_positions,
)
from orchmllm.integrations.transformers.balanced import (
    BalancedModel,
    BalancedOutput,
    shard,
    wrap,
)
from orchmllm.integrations.transformers.save import save_pretrained

__all__ = [
    "ADAPTERS",
    "PACKING_ATTENTION",
    "TEXT_ROPE",
    "Adapter",
    "BalancedModel",
    "BalancedOutput",
    "Item",
    "Source",
    "adapter_for",
    "item_rope",
    "lengths",
    "mrope_positions",
    "qwen",
    "register_adapter",
    "restart_positions",
    "save_pretrained",
    "shard",
    "tiles",
    "wrap",
]
