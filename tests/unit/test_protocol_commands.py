"""The launcher->agent command list in protocol.py is the one the agent
answers: a command added to one and not the other is a command the
launcher sends that agents ignore (they ignore unknown commands silently)."""

from __future__ import annotations

from types import SimpleNamespace

from dsrun.launcher import protocol
from dsrun.launcher.agent import Agent


def test_every_protocol_command_has_an_agent_handler_and_back() -> None:
    stand_in = SimpleNamespace(_stop_command=lambda msg: None)
    handlers = Agent.commands.fget(stand_in)  # type: ignore[attr-defined]
    assert set(handlers) == set(protocol.COMMANDS)
    commands_part = protocol.__doc__.split("The agent writes events")[0]
    described = {line.split()[0] for line in commands_part.splitlines()
                 if line.startswith("  ") and not line.startswith("   ") and line.split()}
    for name in protocol.COMMANDS:  # "pause / resume" share a line
        assert name in described or f"/ {name}" in commands_part, name
