"""RouterConfig: the ingress's settings at the deployment boundary."""
from __future__ import annotations

from pydantic import BaseModel, Field


class RouterConfig(BaseModel):
    model: str = Field(description="Model directory: its tokenizer and chat template are used here.")
    served_model_name: str = Field(description="The name clients put in the `model` field.")
    max_inflight: int = Field(256, ge=1, description="Requests one router replica serves at once; "
                                                     "more get HTTP 429 (the queue bound).")
    max_stop_strings: int = Field(4, description="Most stop strings per request.")
