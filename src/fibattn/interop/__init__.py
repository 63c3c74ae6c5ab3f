"""Other tools' interfaces: the transformers Llama drop-in and the lm-evaluation-harness adapter."""
