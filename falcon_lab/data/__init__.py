"""Data: the embedded corpus, text sources, tokenizers, token shards, the LM datamodule and the registry."""
from falcon_lab.data.registry import (
    available_datamodules,
    build_datamodule,
    get_datamodule_cls,
    register_datamodule,
)
from falcon_lab.data.tokenizer import ByteTokenizer, build_tokenizer

__all__ = ["available_datamodules", "build_datamodule", "get_datamodule_cls", "register_datamodule",
           "ByteTokenizer", "build_tokenizer"]
