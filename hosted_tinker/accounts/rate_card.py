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

Every rate is a plain number (not a string or a boolean), finite, from 0 to `MAX_RATE_USD`: a million
USD per million tokens (a dollar a token) or per GB-month, four orders of magnitude above any
published price, so a typo is caught, and low enough that no cost can overflow: a token cost is at
most its token count and a storage cost its GB-hours x 1389, finite for any usage the server can
count (an `inf` or `1e308` rate made every usage report a 500 once).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

HOURS_PER_MONTH = 720
MAX_RATE_USD = 1_000_000.0


class RateCardError(ValueError):
    """The rate card cannot be used; the message names the file and what is wrong."""




def _not_a_boolean(value):
    if isinstance(value, bool):  # YAML's yes/no/true: a mistake, not a rate of 1 or 0
        raise ValueError("a rate is a number of USD, not a boolean")
    return value


# Finite and bounded (see above). Numbers written as strings are taken: PyYAML reads `1e-6` as one.
CARD = ConfigDict(extra="forbid", allow_inf_nan=False)
Rate = Annotated[float | None, BeforeValidator(_not_a_boolean), Field(ge=0, le=MAX_RATE_USD)]


class ModelRates(BaseModel):
    model_config = CARD
    training: Rate = None
    sampling_prefill: Rate = None
    sampling_prefill_cached: Rate = None
    sampling_sample: Rate = None


class RateCard(BaseModel):
    model_config = CARD
    models: dict[str, ModelRates] = {}
    storage_usd_per_gigabyte_month: Rate = None

    def token_rate(self, base_model: str, kind: str, cached: bool = False) -> float | None:
        """USD per million tokens of `kind` (training, sampling_prefill, sampling_sample) on `base_model`."""
        rates = self.models.get(base_model) or self.models.get("*")
        if rates is None:
            return None
        return getattr(rates, "sampling_prefill_cached" if cached else kind, None)


NO_RATES = RateCard()


def _problem(error: dict) -> str:
    """One validation error as `key = value: what is wrong` (a long value cut short)."""
    key = ".".join(map(str, error["loc"])) or "the card"
    value = repr(error["input"])
    return f"{key} = {value if len(value) <= 60 else value[:57] + '...'}: {error['msg']}"


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
    except ValidationError as e:
        raise RateCardError(f"{path}: {'; '.join(map(_problem, e.errors()))}") from None
    except (ValueError, yaml.YAMLError) as e:
        raise RateCardError(f"{path}: {' '.join(str(e).split())}") from None
    unknown = sorted(set(card.models) - set(served) - {"*"})
    if unknown:
        raise RateCardError(f"{path}: rates for {', '.join(map(repr, unknown))}, which this server does not serve "
                            f"(it serves {', '.join(map(repr, served))}; use '*' for every model)")
    return card
