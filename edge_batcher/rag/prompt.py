"""Prompt assembly: the retrieved passages and the question in the generator's prompt.

[rag] prompt_template has {context} and {question}; each passage is written with
passage_template ({n}: its rank, {title}, {text}, {id}) and the passages are joined by a blank
line. When the prompt and the answer's max_new_tokens do not fit the generator's context, the
lowest-ranked passages are left out until they do (the caller says what fits).
"""

from __future__ import annotations

from collections.abc import Callable

from .index import Hit

DEFAULT_TEMPLATE = (
    "Answer the question using only the context below. If the context does not contain the answer, "
    "say that you do not know. Cite the passages you use by their number, like [1].\n\n"
    "Context:\n{context}\n\nQuestion: {question}\nAnswer:"
)
DEFAULT_PASSAGE_TEMPLATE = "[{n}] {title}\n{text}"


def render(template: str, passage_template: str, question: str, hits: list[Hit]) -> str:
    context = "\n\n".join(
        passage_template.replace("{n}", str(i + 1)).replace("{title}", h.passage.title)
        .replace("{id}", h.passage.id).replace("{text}", h.passage.text)
        for i, h in enumerate(hits))
    # Plain replacement, not str.format: passages and questions may contain braces.
    return template.replace("{context}", context).replace("{question}", question)


def assemble(template: str, passage_template: str, question: str, hits: list[Hit],
             fits: Callable[[str], bool]) -> tuple[str, list[Hit]]:
    """The prompt with as many of the best passages as fit, and the passages it holds."""
    for n in range(len(hits), -1, -1):
        prompt = render(template, passage_template, question, hits[:n])
        if fits(prompt):
            return prompt, hits[:n]
    return render(template, passage_template, question, []), []


def check_template(template: str, where: str) -> None:
    from ..errors import ConfigError

    for field in ("{context}", "{question}"):
        if field not in template:
            raise ConfigError(f"{where}: prompt_template must contain {field}")

