"""Evaluation suites: perplexity (and loss vs position), lm-eval downstream tasks, variable-length
addition, MQAR and passkey retrieval.

Importing this package registers the lm-eval model type ``falcon_lab`` (so
``lm_eval.simple_evaluate(model="falcon_lab", model_args="checkpoint=PATH", ...)`` works); plain
``import falcon_lab`` does not import lm-eval.
"""
from falcon_lab.evaluation.common import (ContinuationScore, TokenizerAdapter, as_tokenizer,
                                          greedy_generate, score_continuations)
from falcon_lab.evaluation.perplexity import (PerplexityResult, PositionCurve, load_texts, perplexity,
                                              position_curve, rolling_pairs)

try:  # registers "falcon_lab" with lm-eval's model registry
    from falcon_lab.evaluation.lm_eval_adapter import FalconLabLM
except ImportError as _e:  # lm-eval missing: everything else still works
    FalconLabLM = None  # type: ignore[assignment]
    _LM_EVAL_IMPORT_ERROR = _e

__all__ = ["ContinuationScore", "TokenizerAdapter", "as_tokenizer", "greedy_generate",
           "score_continuations", "PerplexityResult", "PositionCurve", "load_texts", "perplexity",
           "position_curve", "rolling_pairs", "FalconLabLM"]
