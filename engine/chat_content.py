"""Which content format a chat template reads (vLLM's "auto" chat_template_content_format): a
message's content as a list of parts ("openai") or as one string ("string"), told from the
template's own Jinja syntax tree. LLM.chat (engine/llm.py) and the router's chats with images
(router/images.py) place a message's images by it. Pure functions of the template's text.
"""

from __future__ import annotations


def _reads(node, names: set[str], key: str | None = None) -> bool:
    """Whether a Jinja expression reads one of `names` (its `key` item or attribute, where
    given), through filters, tests and slices (vLLM's _is_var_or_elems_access)."""
    from jinja2 import nodes

    while True:
        if isinstance(node, (nodes.Filter, nodes.Test)) and node.node is not None:
            node = node.node
        elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
            node = node.node
        else:
            break
    if key is None:
        return isinstance(node, nodes.Name) and node.ctx == "load" and node.name in names
    if isinstance(node, nodes.Getitem):
        hit = isinstance(node.arg, nodes.Const) and node.arg.value == key
    elif isinstance(node, nodes.Getattr):
        hit = node.attr == key
    else:
        return False
    return hit and _reads(node.node, names)


def content_format(template: str) -> str:
    """vLLM's "auto" chat template content format: "openai" (content as a list of parts) where
    the template loops over a message's content, else "string" (vLLM's _detect_content_format:
    the messages, the variables set from them, the loops over those, then a loop over such a
    message's content)."""
    from jinja2 import nodes
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        tree = _compile_jinja_template(template).environment.parse(template)
    except Exception:  # a template that does not parse fails when rendered, with its own error
        return "string"
    lists = {"messages"}
    for assign in tree.find_all(nodes.Assign):  # (vLLM's breadth-first search, one pass deep)
        if isinstance(assign.target, nodes.Name) and _reads(assign.node, lists):
            lists.add(assign.target.name)
    loops = list(tree.find_all(nodes.For))
    items = {
        loop.target.name
        for loop in loops
        if isinstance(loop.target, nodes.Name) and _reads(loop.iter, lists)
    }
    return "openai" if any(_reads(loop.iter, items, "content") for loop in loops) else "string"
