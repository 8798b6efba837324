"""Synthetic tasks: variable-length addition, multi-query associative recall, passkey retrieval.

Plain generators (no Lightning). Their datamodules live in :mod:`falcon_lab.data.tasks.datamodules`,
named "addition" and "mqar" in :mod:`falcon_lab.data.registry`.
"""
from falcon_lab.data.tasks.addition import AdditionExample, AdditionTask, format_example, parse_answer
from falcon_lab.data.tasks.mqar import MQARSpec, make_mqar, recover_answers
from falcon_lab.data.tasks.passkey import PasskeyExample, make_passkey, passkey_grid

__all__ = ["AdditionExample", "AdditionTask", "format_example", "parse_answer", "MQARSpec",
           "make_mqar", "recover_answers", "PasskeyExample", "make_passkey", "passkey_grid"]
