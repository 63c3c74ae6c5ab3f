"""Files ``fibattn export --format hf`` copies verbatim into a sparse model's folder (transformers'
remote code, loaded with ``trust_remote_code=True``). fibattn never imports them itself; they need only
torch and transformers."""
