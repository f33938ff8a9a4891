"""The proposer's input and output for one sequence in one engine step (decoded and validated already)."""
from dataclasses import dataclass, field

import torch

# Per-sequence status codes: the gRPC status code numbers.
OK = 0
INVALID_ARGUMENT = 3
NOT_FOUND = 5
RESOURCE_EXHAUSTED = 8
FAILED_PRECONDITION = 9
OUT_OF_RANGE = 11
INTERNAL = 13
UNAVAILABLE = 14  # the drafter is draining: a new sequence must go elsewhere


@dataclass
class StepInput:
    namespace: str
    sequence_id: str
    start_position: int  # p
    token_ids: torch.Tensor  # [m] int64, CPU: committed tokens x[p .. p+m-1]
    hidden_states: torch.Tensor  # [m, W] wire dtype: target hidden states h[p .. p+m-1]; on the CPU when inline,
    # already on the server's device when they came through shared memory (shm_regions.py)
    next_token: int  # x[p+m]
    num_drafts: int  # k asked for
    temperature: float = 0.0
    seed: int = 0
    return_logprobs: bool = False
    top_k_probs: int = 0  # N: describe the draft distribution by its top N (0 = no)
    owner: str | None = None  # "stream N" / "step channel N": a sequence this step creates is freed when it ends
    predraft_branches: int = 0  # pre-drafting budget F (predraft.py); 0 = off

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0]


@dataclass
class StepOutput:
    code: int = OK
    message: str = ""
    drafts: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_k_ids: torch.Tensor | None = None  # [k, N] int64 target ids, when the step asked for top_k_probs = N
    top_k_probs: torch.Tensor | None = None  # [k, N] float32
    accepted_drafts: int = 0
    committed_length: int = 0
    predrafted: bool = False  # answered from branches prepared while the engine verified (predraft.py)
