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
