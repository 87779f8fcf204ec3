"""`ModelRegistry`: finds a served base model by the name a request carries."""

from __future__ import annotations

import pytest

from hosted_tinker.errors import UserError
from hosted_tinker.server.served_models import ModelRegistry, ServedModel


def served(name: str) -> ServedModel:
    # Only the name matters to the registry: the parts are not built here.
    return ServedModel(name=name, tokenizer=None, eos_token_ids=set(), runtime=None, scheduler=None, worker=None,
                       sampling_backend=None, sampler=None, loop=None, kv_budget=None)


def test_registry_routes_by_base_model_and_names_what_it_serves():
    a, b = served("org/model-a"), served("org/model-b")
    registry = ModelRegistry([a, b])
    assert registry.get("org/model-b") is b and list(registry) == [a, b] and registry.names == ["org/model-a",
                                                                                                 "org/model-b"]
    with pytest.raises(UserError, match=r"base model 'other' is not served here; this server serves "
                                        r"'org/model-a', 'org/model-b'"):
        registry.get("other")
    with pytest.raises(ValueError):
        ModelRegistry([])
