"""The families' bundles (``ModelSpec``) are the one list of families: the registry, the Hugging
Face importer and the job spec's help texts agree with them."""

import re

from hpservice.models import HF_FAMILIES, MODEL_SPECS, list_models, model_class
from hpservice.models.hf import FAMILIES
from hpservice.spec.model import ModelSpec as ModelSection


def test_the_registry_and_the_hf_importer_come_from_the_bundles():
    assert list_models() == sorted(MODEL_SPECS)
    assert tuple(n for n, s in MODEL_SPECS.items() if s.hf is not None) == HF_FAMILIES
    assert {n: (s.hf.model_type, s.hf.architecture) for n, s in MODEL_SPECS.items() if s.hf} == FAMILIES
    for name, spec in MODEL_SPECS.items():
        assert spec.name == name and model_class(name) is spec.model_cls
        assert spec.flavors and spec.description


def _listed(text: str) -> set[str]:
    return set(re.findall(r"[a-z][a-z0-9_]+", text)) & set(MODEL_SPECS)


def test_the_job_specs_help_texts_name_every_family():
    """The spec is torch-free, so it spells the lists; this ties them to the bundles."""
    fields = ModelSection.model_fields
    assert _listed(fields["name"].description.split(" or ")[0]) == set(MODEL_SPECS)
    assert _listed(fields["init_from"].description.split(":")[0]) == set(HF_FAMILIES)


def test_the_pipeline_split_comes_from_the_bundle():
    """Each family declares its stage trim; split_model uses the bundle's, and a model without one
    is refused naming what it lacks."""
    import pytest
    import torch
    from torch import nn

    from hpservice.models import build_model, factory_model_spec
    from hpservice.parallel.pipelining import split_model
    from hpservice.spec import parse_job
    from hpservice.train import TrainingError
    from hpservice.train._pipeline import apply_pp

    trims = []
    for name, spec in MODEL_SPECS.items():
        assert spec.pipeline_stage is not None, name
        model = build_model(name, "tiny", {}, device="meta")

        def trim(part, layers, *, first, last, bundle=spec):
            trims.append((bundle.name, tuple(layers), first, last))
            bundle.pipeline_stage(part, layers, first=first, last=last)

        (s0, first), (s1, last) = split_model(model, 0, 1, 2, keep_stage=trim)
        assert (s0, s1) == (0, 1) and trims[-2][2:] == (True, False) and trims[-1][2:] == (False, True)
        assert set(first.layers) | set(last.layers) == set(model.layers) and not set(first.layers) & set(last.layers)
    plain = nn.Sequential(nn.Linear(2, 2))
    with torch.device("meta"):
        bundle = factory_model_spec("pkg.mod:plain", plain)
    assert bundle.pipeline_stage is None
    job = parse_job({"name": "p", "parallelism": {"pp": 2}, "resources": {"workers": 2}})
    with pytest.raises(TrainingError, match="declares no pipeline split"):
        apply_pp(plain, 0, job, bundle)
