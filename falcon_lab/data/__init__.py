"""Data: the embedded corpus, tokenizers, the LM datamodule and the datamodule registry."""
from falcon_lab.data.registry import (  # noqa: F401
    available_datamodules,
    build_datamodule,
    get_datamodule_cls,
    register_datamodule,
)
from falcon_lab.data.tokenizer import ByteTokenizer, build_tokenizer  # noqa: F401
