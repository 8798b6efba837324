"""falcon_lab: a benchmark and ablation platform for the Falcon fast-weight attention family.

Importing the package is cheap: subpackages (kernels, models, training, evaluation) are imported
on use, so `import falcon_lab` never pulls in Lightning, MLflow or lm-eval.
"""

__version__ = "0.1.0"
