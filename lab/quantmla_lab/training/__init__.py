"""The reference models: corpus split (``data``), tokenizer, retrieval tasks, families and training
(``train``); ``quantmla train-reference`` (``command``)."""
