"""Synthetic tasks: variable-length addition, multi-query associative recall, passkey retrieval.

Plain generators (no Lightning). Their datamodules live in :mod:`falcon_lab.data.tasks.datamodules`
and register with :func:`falcon_lab.data.register_datamodule` as "addition" and "mqar".
"""
from falcon_lab.data.tasks.addition import AdditionExample, AdditionTask, format_example, parse_answer
from falcon_lab.data.tasks.mqar import MQARSpec, make_mqar, recover_answers
from falcon_lab.data.tasks.passkey import PasskeyExample, make_passkey, passkey_grid
from falcon_lab.data.tasks import datamodules  # noqa: F401  (registers "addition" and "mqar")

__all__ = ["AdditionExample", "AdditionTask", "format_example", "parse_answer", "MQARSpec",
           "make_mqar", "recover_answers", "PasskeyExample", "make_passkey", "passkey_grid"]
