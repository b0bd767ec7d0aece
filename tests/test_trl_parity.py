"""GRPOConfig has every field of the installed TRL's GRPOConfig, with TRL's default (skipped without TRL)."""
import dataclasses

import pytest

from grpo_lab import GRPOConfig

trl = pytest.importorskip("trl")

GRPO_LAB_ONLY = {"max_prompt_length", "vllm_dtype", "overwrite_output_dir", "generation_engine",
                 "log_format",                                        # issue 41
                 "dynamic_sampling", "dynamic_sampling_max_rounds"}   # DAPO's, issue 43: TRL 1.16 has no such field


def defaults(cls) -> dict:
    return {f.name: (f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default)
            for f in dataclasses.fields(cls)}


def test_every_trl_field_with_trls_default():
    ours, theirs = defaults(GRPOConfig), defaults(trl.GRPOConfig)
    assert set(theirs) <= set(ours), sorted(set(theirs) - set(ours))
    assert set(ours) - set(theirs) == GRPO_LAB_ONLY
    differing = {k: (ours[k], theirs[k]) for k in theirs if ours[k] != theirs[k]}
    assert differing == {}, differing


def test_refused_options_are_trl_fields():
    from grpo_lab.config import REFUSED_OPTIONS
    assert set(REFUSED_OPTIONS) <= set(defaults(trl.GRPOConfig))
