"""A tiny stand-in for the ``fire`` package (python-fire), for tests of the
``--local_rank`` fill-in (dsrun/runtime/localrank.py) where fire is not
installed.

It keeps the parts of fire's calling convention that the fill-in relies on
(fire 0.7's ``fire/core.py``):

* ``fire/__init__.py`` re-exports ``Fire`` from ``fire.core``;
* ``Fire(component=None, command=None, name=None, serialize=None)`` takes
  ``sys.argv[1:]`` when ``command`` is None, splits off what follows the last
  ``--``, takes its caller's globals and locals when ``component`` is None,
  and hands ``(component, args, flags, context, name)`` to ``core._Fire``.

``_Fire`` itself handles only functions, classes (a class is built from
flags only, as fire does, then the method the next argument names is
called) and dicts (the next argument
names the member: fire's view of ``Fire()``'s caller context). It reads ``--name=value`` and
``--name value`` flags (``-`` in a name read as ``_``) and positional
arguments, and it rejects arguments nothing takes, as fire does. It prints
the result as JSON, one line.
"""

from __future__ import annotations

from pathlib import Path

INIT = "from fire.core import Fire\n"

CORE = '''
import ast, inspect, json, sys


class FireExit(SystemExit):
    pass


def _value(text):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _call(fn, args, flags_only=False):
    params = [p for p in inspect.signature(fn).parameters.values()
              if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    names = {p.name for p in params}
    kwargs, positional, rest, i = {}, [], [], 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("-"):
            key, eq, value = arg.lstrip("-").partition("=")
            key = key.replace("-", "_")
            if key not in names:
                rest.append(arg)
            elif eq:
                kwargs[key] = _value(value)
            else:
                i += 1
                kwargs[key] = _value(args[i])
        else:
            positional.append(arg)
        i += 1
    free = [p.name for p in params
            if p.name not in kwargs and p.kind == p.POSITIONAL_OR_KEYWORD]
    for name in free:
        if positional and not flags_only:
            kwargs[name] = _value(positional.pop(0))
    return fn(**kwargs), rest + positional


def _Fire(component, args, flags, context, name=None):
    if component is None:
        component = context
    if isinstance(component, dict):  # the next argument names a member
        args = list(args)
        member = next(a for a in args if not a.startswith("-"))
        args.remove(member)
        component = component[member]
    if inspect.isclass(component):
        instance, rest = _call(component, list(args), flags_only=True)
        command = [a for a in rest if not a.startswith("-")]
        if not command:
            return instance
        rest.remove(command[0])
        result, rest = _call(getattr(instance, command[0]), rest)
    else:
        result, rest = _call(component, list(args))
    if rest:
        sys.stderr.write(f"ERROR: Could not consume arg: {rest[0]}\\n")
        raise FireExit(2)
    return result


def Fire(component=None, command=None, name=None, serialize=None):
    args = list(sys.argv[1:] if command is None else command)
    flags = []
    if "--" in args:
        cut = len(args) - 1 - args[::-1].index("--")
        args, flags = args[:cut], args[cut + 1:]
    context = {}
    if component is None:
        caller = inspect.stack()[1][0]
        context.update(caller.f_globals)
        context.update(caller.f_locals)
    result = _Fire(component, args, flags, context, name)
    print(json.dumps(result), flush=True)
    return result
'''


def write_fire_standin(directory: Path) -> Path:
    """Write the stand-in ``fire`` package into ``directory`` (to be put on
    ``sys.path`` / ``PYTHONPATH``); returns ``directory``."""
    package = directory / "fire"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text(INIT)
    (package / "core.py").write_text(CORE)
    return directory
