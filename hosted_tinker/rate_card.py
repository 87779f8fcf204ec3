"""The operator's rate card (`--rate-card FILE`): USD rates that turn usage into estimated costs.

    models:                          # per served base model; "*" for every model not listed
      Qwen/Qwen3-8B:
        training: 0.40               # USD per million tokens, forward and forward_backward
        sampling_prefill: 0.20       # per million prompt tokens computed
        sampling_prefill_cached: 0.05  # per million prompt tokens served from a prefix cache
        sampling_sample: 0.60        # per million sampled tokens
    storage_usd_per_gigabyte_month: 0.02   # 1 GB-month = 720 GB-hours, as the SDK counts

A rate left out is unknown: its costs are null, as without a card. Costs follow the SDK's formulas:
tokens x rate / 1e6, and GB-hours x rate / 720.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

HOURS_PER_MONTH = 720


class RateCardError(ValueError):
    """The rate card cannot be used; the message names the file and what is wrong."""


class ModelRates(BaseModel):
    model_config = ConfigDict(extra="forbid")
    training: float | None = Field(None, ge=0)
    sampling_prefill: float | None = Field(None, ge=0)
    sampling_prefill_cached: float | None = Field(None, ge=0)
    sampling_sample: float | None = Field(None, ge=0)


class RateCard(BaseModel):
    model_config = ConfigDict(extra="forbid")
    models: dict[str, ModelRates] = {}
    storage_usd_per_gigabyte_month: float | None = Field(None, ge=0)

    def token_rate(self, base_model: str, kind: str, cached: bool = False) -> float | None:
        """USD per million tokens of `kind` (training, sampling_prefill, sampling_sample) on `base_model`."""
        rates = self.models.get(base_model) or self.models.get("*")
        if rates is None:
            return None
        return getattr(rates, "sampling_prefill_cached" if cached else kind, None)


NO_RATES = RateCard()


def load_rate_card(path: Path | None, served: list[str]) -> RateCard:
    """The card in `path` (YAML or JSON), every model it names among `served` (or "*"); no file: no rates."""
    if path is None:
        return NO_RATES
    try:
        text = Path(path).read_text()
        data = json.loads(text) if Path(path).suffix.lower() == ".json" else yaml.safe_load(text)
        card = RateCard.model_validate(data or {})
    except OSError as e:
        raise RateCardError(f"{path}: cannot read it ({e.strerror})") from None
    except (ValueError, yaml.YAMLError) as e:
        problem = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()) if isinstance(
            e, ValidationError) else " ".join(str(e).split())
        raise RateCardError(f"{path}: {problem}") from None
    unknown = sorted(set(card.models) - set(served) - {"*"})
    if unknown:
        raise RateCardError(f"{path}: rates for {', '.join(map(repr, unknown))}, which this server does not serve "
                            f"(it serves {', '.join(map(repr, served))}; use '*' for every model)")
    return card
