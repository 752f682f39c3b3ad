"""The model: built from a config, a pretrained folder or a GGUF file, with its tokenizer and
seeded initial weights (:mod:`.build`); LoRA adapters and frozen parameters through peft
(:mod:`.adapters`); the mixture-of-experts router monitor and load-balancing loss (:mod:`.moe`);
the output layer's loss in chunks of tokens (:mod:`.chunked_loss`).

Knows nothing of ranks, meshes or engines: it may import :mod:`llmtrain.config` and
:mod:`llmtrain.common` only."""
