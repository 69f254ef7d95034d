"""Task sources for RL: the Environment interface (base.py) and the built-in ones, chosen by `name`."""

from __future__ import annotations

from typing import Annotated, Union

from pydantic import Discriminator, Tag

from prime.rl.environments.base import Environment
from prime.rl.environments.math_answers import MathConfig
from prime.rl.environments.reasoning_gym import ReasoningGymConfig
from prime.rl.environments.reverse import ReverseConfig
from prime.rl.environments.terms import RewardTerms, WithTerms


def _env_name(value) -> str:
    """The `name` of an env section; a section without one is the built-in reverse task's."""
    return value.get("name", "reverse") if isinstance(value, dict) else getattr(value, "name", "reverse")


EnvConfig = Annotated[Union[Annotated[ReverseConfig, Tag("reverse")], Annotated[ReasoningGymConfig, Tag("reasoning-gym")],
                            Annotated[MathConfig, Tag("math")]], Discriminator(_env_name)]


def build_environment(config: EnvConfig, terms: RewardTerms | None = None) -> Environment:
    if isinstance(config, ReverseConfig):
        from prime.rl.environments.reverse import ReverseDigits
        env: Environment = ReverseDigits(config)
    elif isinstance(config, ReasoningGymConfig):
        from prime.rl.environments.reasoning_gym import ReasoningGym
        env = ReasoningGym(config)
    else:
        from prime.rl.environments.math_answers import MathAnswers
        env = MathAnswers(config)
    return WithTerms(env, terms) if terms is not None and terms.active else env
