"""The sweep's Optuna study, through Optuna's public API only.

Optuna keeps a study's storage and a trial's storage id private (``study._storage``,
``trial._trial_id``). The sweep opens the storage itself (:func:`open_study`), keeps its own reference
to it in a :class:`SweepStudy`, and finds a trial's id with the storage's public
``get_trial_id_from_study_id_trial_number``: heartbeats, stale-trial recovery, a trial's system
attributes and a multi-device job's reports all go through that storage object.

Trials are asked and told (``study.ask`` / ``study.tell``), not run by ``study.optimize``: the loop
checks the budget before asking, decides COMPLETE / PRUNED / FAIL itself, and a failed trial is a
recorded outcome, not an exception. Under ask/tell, ``Study.stop()`` raises (it only works inside
``study.optimize``); the grid and brute-force samplers call it from ``after_trial`` once every point
has been asked, so the space's sampler is wrapped in :class:`LoopDecidesStop`.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import optuna
from optuna.samplers import BaseSampler

from .storage import open_storage


class _StudyWithoutStop:
    """The study as a sampler's ``after_trial`` sees it, with ``stop()`` doing nothing."""

    def __init__(self, study) -> None:
        self._wrapped = study

    def stop(self) -> None:
        pass

    def __getattr__(self, name: str):
        return getattr(self._wrapped, name)


class LoopDecidesStop(BaseSampler):
    """The search space's sampler, except that it cannot stop the study.

    The sweep's loop stops when COMPLETE + PRUNED trials reach the budget (failed trials do not
    count; a killed one is re-enqueued), so a sampler's "every point has been asked" is not the end
    of the sweep. Every method is the wrapped sampler's; ``after_trial`` gets a study whose
    ``stop()`` is a no-op (see the module docstring)."""

    def __init__(self, sampler: BaseSampler) -> None:
        self.sampler = sampler

    def __str__(self) -> str:
        return str(self.sampler)

    def infer_relative_search_space(self, study, trial):
        return self.sampler.infer_relative_search_space(study, trial)

    def sample_relative(self, study, trial, search_space):
        return self.sampler.sample_relative(study, trial, search_space)

    def sample_independent(self, study, trial, param_name, param_distribution):
        return self.sampler.sample_independent(study, trial, param_name, param_distribution)

    def before_trial(self, study, trial) -> None:
        self.sampler.before_trial(study, trial)

    def after_trial(self, study, trial, state, values) -> None:
        self.sampler.after_trial(_StudyWithoutStop(study), trial, state, values)

    def reseed_rng(self) -> None:
        self.sampler.reseed_rng()


@dataclasses.dataclass
class SweepStudy:
    """An ``optuna.Study`` with the storage object the sweep opened for it and its id there."""

    study: optuna.Study
    storage: optuna.storages.BaseStorage
    study_id: int
    _ids: dict = dataclasses.field(default_factory=dict, repr=False)

    def trial_id(self, number: int) -> int:
        """The storage's id of trial ``number`` (what the storage's trial methods take)."""
        if number not in self._ids:
            self._ids[number] = self.storage.get_trial_id_from_study_id_trial_number(
                self.study_id, number)
        return self._ids[number]

    def system_attrs(self, number: int) -> dict[str, Any]:
        return self.storage.get_trial_system_attrs(self.trial_id(number))

    def frozen(self, number: int) -> optuna.trial.FrozenTrial:
        """Trial ``number`` as stored now (one trial, not the whole study)."""
        return self.storage.get_trial(self.trial_id(number))


def open_study(url: str, name: str, sampler: BaseSampler | None = None, pruner=None,
               storage=None) -> SweepStudy:
    """Load study ``name`` from the storage string ``url`` (or an already opened ``storage``).
    ``sampler`` is wrapped in :class:`LoopDecidesStop`."""
    storage = storage if storage is not None else open_storage(url)
    study = optuna.load_study(study_name=name, storage=storage, pruner=pruner,
                              sampler=LoopDecidesStop(sampler) if sampler is not None else None)
    return SweepStudy(study, storage, storage.get_study_id_from_name(name))


def trial_in_job(url: str, name: str, number: int, pruner) -> optuna.trial.Trial:
    """Trial ``number`` of a running study, for the separate process of a multi-device trial: its
    reports and ``should_prune()`` go through the storage to the same trial the worker asked."""
    s = open_study(url, name, pruner=pruner)
    return optuna.trial.Trial(s.study, s.trial_id(number))
