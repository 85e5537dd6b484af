"""Adapters for the stacks users train with; each is an optional extra.

``orchmllm.integrations.transformers`` balances Hugging Face vision-language models;
``orchmllm.integrations.trainer`` balances a ``transformers.Trainer`` (and TRL's trainers). Nothing
here is imported by ``import orchmllm``, and the integrations use only the public API, as an
outside user would.
"""
