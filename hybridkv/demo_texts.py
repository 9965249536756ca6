"""Prompts for the demo, the real-model tests and benchmarks: a library's
information desk, written for a base (not instruction-tuned) model, so every
prompt ends where an answer starts.

SYSTEM is the shared preamble (a few hundred tokens: what prefix caching
saves); HISTORY is a long article that pushes a prompt past Gemma-3's
512-token sliding window."""

from __future__ import annotations

SYSTEM = """The following is a record of questions asked at the information desk of the Riverside City Library, \
with the librarian's answers. The answers are short, factual and friendly, and they always name the floor or the \
room where something can be found.

About the library. The Riverside City Library has four floors and a basement. The ground floor holds the front \
desk, the returns machine, new arrivals, newspapers and magazines, and the children's room with its reading corner. \
The first floor holds fiction, arranged by the author's surname, with separate shelves for crime, science fiction, \
poetry and plays. The second floor holds non-fiction, arranged by subject: history and geography near the windows, \
science and mathematics in the middle, art, music and cooking along the back wall. The third floor is the quiet \
study floor, with forty desks, six group rooms that can be booked for two hours at a time, and the local history \
archive, which is open on weekday afternoons. The basement holds the maker space, with two 3D printers, a sewing \
machine and a sound booth, and it is open to members over fourteen.

Opening hours are nine in the morning to eight in the evening from Monday to Friday, and ten to five on Saturday. \
The library is closed on Sunday. Members may borrow up to twelve items for three weeks and renew them twice online. \
Computers on the ground floor can be used for one hour a day without booking. Printing costs ten cents a page.
"""

QUESTIONS = [
    "Where can I find books about the history of Rome?",
    "Can my daughter, who is nine, use the 3D printers?",
    "How long can I keep a novel I borrow today?",
    "Is the library open on Sunday afternoon?",
    "Where are the poetry books?",
    "I need a quiet room for a study group of five people. What can you offer?",
    "Where do I return books when the front desk is closed?",
    "How much does it cost to print a twenty-page report?",
    "Where would I find a cookbook about Italian food?",
    "When can I visit the local history archive?",
    "Where are today's newspapers?",
    "Can I use a computer without booking?",
    "Where is the science fiction section?",
    "What time does the library close on Saturday?",
    "Where can my son read picture books?",
    "How many books can I borrow at once?",
]

HISTORY = """A short history of the library, from the guide at the entrance. The first public reading room in \
Riverside opened in 1871 above a bakery on Mill Street. It held about six hundred books, most of them donated by \
the families who had built the town's first cotton mill, and it was open two evenings a week. A retired teacher, \
Margaret Olsen, kept the catalogue by hand in a set of green ledgers, three of which survive in the local history \
archive. In 1894 the town council bought a former grain warehouse by the river and converted it into a library \
with a lending room, a reference room and a small museum of local finds. The warehouse flooded twice, in 1903 and \
again in 1927, and after the second flood nearly a third of the collection had to be thrown away. The council then \
decided to build on higher ground. The present building on Hill Road was designed by the architect Thomas Reyes, \
who won a competition against eleven other entries with a plan that put the reading rooms on the upper floors and \
the stores in a dry basement. It opened in 1932, during the depression, and for its first years it was run largely \
by volunteers. During the war the basement served as a shelter, and the children's room was used as a school for \
two winters after the primary school on Elm Street was damaged by fire. In 1968 a new wing added the study floor \
and the group rooms, paid for by a public appeal that raised money from more than four thousand households. The \
card catalogue was replaced by computers in 1991, and the library joined the regional lending network in 1998, \
which lets members borrow books from forty other libraries and collect them at the front desk. The most recent \
change came in 2019, when the basement stores moved to a regional depot and the space became the maker space, with \
its printers, its sewing machine and its sound booth. Today the library lends about three hundred thousand items a \
year, hosts reading groups, language cafes and homework clubs, and keeps the original green ledgers, the architect's \
drawings and photographs of both floods in the local history archive on the third floor.
"""

LONG_QUESTIONS = [
    "In which year did the library move into the building on Hill Road?",
    "Who kept the first catalogue, and where are her ledgers today?",
]


def question_prompt(question: str) -> str:
    return f"{SYSTEM}\nQ: {question}\nA:"


def long_prompt(question: str) -> str:
    """Over 512 tokens for Gemma-3's tokenizer: the history, then the question."""
    return f"{SYSTEM}\n{HISTORY}\nQ: {question}\nA:"


def quoting_prompt() -> str:
    """A passage, then the start of its copy: the answer quotes the prompt
    (where speculative decoding by prompt lookup pays)."""
    sentences = HISTORY.split(". ")
    passage = ". ".join(sentences[:8]) + "."
    return (f"Below is a passage, then the same passage copied out again word for word.\n\nPassage:\n{passage}\n\n"
            f"Copy:\n{sentences[0]}.")
