"""The prefix workload's requests: one long shared system prompt (a made-up outdoor shop's
support policies, built from sentence templates with a seed, in the model's chat template) and
short distinct questions behind it, each opening with a different customer's name so that no
two questions share a first block. A model without a tokenizer gets random token ids.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass

QUESTION_TOKENS = (20, 40)  # the question's own text, before the chat template's wrapping
ENGINE_WARMUP_TOKENS = 256  # the unrelated first request of every engine (at most this, at most the prefix)


PRODUCTS = (("tent", "tents"), ("sleeping bag", "sleeping bags"), ("rain jacket", "rain jackets"),
            ("backpack", "backpacks"), ("camping stove", "camping stoves"), ("down jacket", "down jackets"),
            ("headlamp", "headlamps"), ("water filter", "water filters"), ("kayak paddle", "kayak paddles"),
            ("fleece sweater", "fleece sweaters"), ("trekking pole set", "trekking pole sets"),
            ("climbing harness", "climbing harnesses"))
REGIONS = ("Germany", "France", "the Netherlands", "Austria", "Denmark", "Spain", "Italy", "Sweden", "Ireland",
           "Portugal", "Belgium", "Poland")
CITIES = ("Hamburg", "Lyon", "Utrecht", "Graz", "Aarhus", "Valencia", "Turin", "Uppsala", "Cork", "Porto")
WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday")
CONDITIONS = ("unused and in its original packaging", "unworn with the labels still attached",
              "in the condition it was delivered in", "complete with all its parts")
DAMAGES = ("with a torn seam", "with a broken zip", "scratched", "wet from the rain", "with a missing part",
           "in the wrong colour", "in the wrong size")
CHANNELS = ("phone", "email", "the chat on our website", "the contact form")
MEMBERS = ("Members of the Northwind Club", "Customers with a loyalty card", "Students with a valid card",
           "Mountain guides")
NAMES = ("Anna", "Ben", "Clara", "David", "Emma", "Felix", "Greta", "Hugo", "Ida", "Jonas", "Karin", "Lukas",
         "Maria", "Nils", "Olga", "Paul", "Rosa", "Simon", "Tina", "Ulrich", "Vera", "Walter", "Yara", "Zoe",
         "Alice", "Bruno", "Carla", "Daniel", "Eva", "Frank", "Gina", "Henrik", "Irene", "Jan", "Kurt", "Lena",
         "Moritz", "Nora", "Oscar", "Petra", "Quentin", "Rita", "Stefan", "Tobias", "Ursula", "Viktor", "Wanda",
         "Xavier", "Yusuf", "Zora", "Adam", "Bianca", "Chris", "Dora", "Erik", "Fiona", "George", "Helen",
         "Igor", "Julia", "Mehmet", "Sofia", "Omar", "Leila", "Pablo", "Ines", "Kenji", "Amara", "Ravi", "Lucia")
SECTIONS = ("Orders", "Shipping", "Returns", "Refunds", "Warranty", "Repairs", "Gift cards", "Loyalty points",
            "Rentals", "Store pickup", "Damaged deliveries", "Contact")

INTRO = ("You are the customer support assistant of Northwind Outfitters, an online shop for outdoor clothing "
         "and camping gear with stores in several European cities. Answer the customer's question briefly and "
         "politely, using only the policies below. If the policies do not cover a question, say so and offer "
         "to pass it on to a human colleague.\n\n")

POLICY_TEMPLATES = (
    "Customers in {region} can return a {product} within {days} days of delivery if it is {condition}.",
    "Orders placed before {hour} o'clock on a {weekday} usually leave our warehouse on the same day.",
    "Standard shipping to {region} takes {low} to {high} working days, and express shipping takes {low} days "
    "at most.",
    "A {product} that is returned {condition} is refunded in full, minus a handling fee of {amount} euros.",
    "{members} receive {percent} percent off {products} and free shipping on orders above {amount} euros.",
    "Refunds are paid to the original payment method within {days} days after the returned item reaches us.",
    "The warranty on a {product} covers manufacturing faults for {years} years but not normal wear and tear.",
    "Repairs of a {product} are free during the first {years} years; after that we charge {amount} euros plus "
    "parts.",
    "Gift cards are valid for {years} years and can be used online and in all {count} of our stores.",
    "Customers can reach a human colleague by {channel} between {hour} and {close} o'clock on working days.",
    "We do not send {products} with gas cartridges to {region}, because the carriers there refuse them.",
    "Rented {products} must come back clean and dry within {days} days, or a late fee of {amount} euros per "
    "day applies.",
    "Loyalty points expire after {months} months and are worth {cents} cents each at checkout.",
    "Store pickup is available in {city}, where orders are ready {low} hours after payment.",
    "If a {product} arrives {damage}, the customer should send a photo by {channel} within {days} days.",
    "An exchange for another size or colour of a {product} is free once per order if it is {condition}.",
)

QUESTION_TEMPLATES = (
    "I bought a {product} {days} days ago and it arrived {damage}. Can I still return it, and how long will "
    "the refund take?",
    "How long does express shipping to {region} take if I order a {product} on a {weekday} afternoon?",
    "My {product} broke after {years} years of normal use. Is the repair free, or do I have to pay for it?",
    "Do {members_lower} get free shipping on a {product} that costs {amount} euros, and can I pick it up in "
    "{city}?",
    "I want to rent a {product} for a {days}-day trip. What happens if I bring it back two days late?",
    "Can I pay for a {product} with a gift card I received {years} years ago, and does it also work in "
    "{city}?",
    "How many loyalty points do I need for a discount of {amount} euros on a new {product}?",
    "The {product} I ordered to {region} has not arrived after {days} days. Whom can I contact, and when?",
    "I received a {product} {damage}. Should I send it back right away, or do you need a photo first?",
    "Can I exchange the {product} I ordered last {weekday} for another colour if it is {condition}?",
)


def _fill(rng: random.Random, template: str) -> str:
    product, products = rng.choice(PRODUCTS)
    members = rng.choice(MEMBERS)
    low = rng.randint(1, 4)
    hour = rng.randint(8, 11)
    return template.format(
        product=product, products=products, region=rng.choice(REGIONS), city=rng.choice(CITIES),
        weekday=rng.choice(WEEKDAYS), condition=rng.choice(CONDITIONS), damage=rng.choice(DAMAGES),
        channel=rng.choice(CHANNELS), members=members, members_lower=members[0].lower() + members[1:],
        days=rng.choice((7, 14, 21, 30, 60, 90)), hour=hour, close=hour + rng.randint(7, 10), low=low,
        high=low + rng.randint(1, 4), amount=rng.choice((5, 10, 15, 25, 50, 80, 100, 150)),
        percent=rng.choice((5, 10, 15, 20)), years=rng.randint(1, 5), count=rng.randint(6, 40),
        months=rng.choice((6, 12, 18, 24, 36)), cents=rng.choice((1, 2, 5, 10)))


@dataclass
class PrefixPrompts:
    """The token ids of every request of the workload (the same for every configuration)."""

    shared: int  # tokens every prompt (and the prefix warm-up) starts with
    serial: list[list[int]]  # run one at a time (TTFT)
    batch: list[list[int]]  # other questions, run all at once (throughput)
    prefix_warmup: list[int]  # the shared prefix and a question of its own
    engine_warmup: list[int]  # unrelated: shares no block with the rest

    @property
    def question_lens(self) -> list[int]:
        return [len(p) - self.shared for p in self.serial + self.batch]


def shared_len(prompts: list[list[int]]) -> int:
    """Tokens the prompts have in common at their start."""
    first, n = prompts[0], min(map(len, prompts))
    return next((i for i in range(n) if any(p[i] != first[i] for p in prompts)), n)


def prefix_prompts(llm, prefix_len: int, num_requests: int, seed: int = 0) -> PrefixPrompts:
    """The workload for `llm`'s model: text through its tokenizer (and chat template when it has
    one), else random token ids."""
    if prefix_len < 1 or num_requests < 1:
        raise ValueError(f"--prefix-len and --num-requests must be positive, got {prefix_len} and {num_requests}")
    tokenizer = llm.get_tokenizer()
    if tokenizer is None:
        return random_prompts(llm.engine.source.hf_config.vocab_size, prefix_len, num_requests, seed)
    return text_prompts(tokenizer, prefix_len, num_requests, seed)


def random_prompts(vocab_size: int, prefix_len: int, num_requests: int, seed: int = 0) -> PrefixPrompts:
    rng = random.Random(seed)

    def draw(n: int) -> list[int]:
        return [rng.randrange(100, vocab_size) for _ in range(n)]

    prefix = draw(prefix_len)
    questions = [draw(rng.randint(*QUESTION_TOKENS)) for _ in range(2 * num_requests + 1)]
    prompts = [prefix + q for q in questions]
    return PrefixPrompts(prefix_len, prompts[:num_requests], prompts[num_requests:-1], prompts[-1],
                         draw(min(prefix_len, ENGINE_WARMUP_TOKENS)))


def text_prompts(tokenizer, prefix_len: int, num_requests: int, seed: int = 0) -> PrefixPrompts:
    rng = random.Random(seed)

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    def count(text: str) -> int:
        return len(encode(text))

    if tokenizer.chat_template:
        def render(system: str, question: str) -> list[int]:
            ids = tokenizer.apply_chat_template([{"role": "system", "content": system},
                                                 {"role": "user", "content": question}],
                                                add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)  # a dict or a BatchEncoding
    else:
        def render(system: str, question: str) -> list[int]:
            return list(tokenizer(f"{system}\n\nQuestion: {question}\nAnswer:", add_special_tokens=True)["input_ids"])

    questions = _questions(rng, encode, 2 * num_requests + 1)
    probe = INTRO.strip()
    overhead = shared_len([render(probe, q) for q in questions[:2]]) - count(probe)
    system = _system_prompt(rng, count, max(1, prefix_len - overhead))
    prompts = [render(system, q) for q in questions]
    warmup_text = " ".join(_questions(random.Random(seed + 1), encode, 40))
    warmup = tokenizer(warmup_text, add_special_tokens=True)["input_ids"][:min(prefix_len, ENGINE_WARMUP_TOKENS)]
    return PrefixPrompts(shared_len(prompts), prompts[:num_requests], prompts[num_requests:-1], prompts[-1],
                         list(warmup))


def _questions(rng: random.Random, encode, n: int) -> list[str]:
    """`n` distinct questions of QUESTION_TOKENS tokens (as far as the templates allow), each
    opened by a customer's name whose first token no other question starts with (while NAMES
    last): questions drawn from the same templates often begin alike, and a question's first
    block after the prefix would then be a cache hit beyond the shared prefix."""
    out: list[str] = []
    for name in _names(rng, encode, n):
        for attempt in range(100):
            q = f"{name} here. {_fill(rng, rng.choice(QUESTION_TEMPLATES))}"
            if q not in out and (QUESTION_TOKENS[0] <= len(encode(q)) <= QUESTION_TOKENS[1] or attempt == 99):
                out.append(q)
                break
    return out


def _names(rng: random.Random, encode, n: int) -> list[str]:
    """`n` names in a seeded order: first those with distinct first tokens, then any."""
    pool = list(NAMES)
    rng.shuffle(pool)
    firsts, unique, rest = set(), [], []
    for name in pool:
        first = encode(name)[0]
        (rest if first in firsts else unique).append(name)
        firsts.add(first)
    names = unique + rest
    return [names[i % len(names)] for i in range(n)]


def _system_prompt(rng: random.Random, count, target: int) -> str:
    """The intro and numbered policy sections, cut to `target` tokens at most (whole sentences,
    then whole words of the next one, then letters of the word that does not fit)."""
    text, section = INTRO.strip(), 0
    if count(text) > target:
        text = ""
    while True:
        section += 1
        heading = ("\n\n" if text else "") + f"Policy {section}: {SECTIONS[(section - 1) % len(SECTIONS)]}."
        sentences = [_fill(rng, rng.choice(POLICY_TEMPLATES)) for _ in range(rng.randint(3, 5))]
        for i, sentence in enumerate(sentences):
            piece = (heading + " " if i == 0 else " ") + sentence
            if count(text + piece) <= target:
                text += piece
                continue
            for word in piece.split(" "):  # fill the rest word by word, then letter by letter
                if not word:
                    continue
                joined = text + ("" if not text or word.startswith("\n") else " ") + word
                if count(joined) <= target:
                    text = joined
                    continue
                for end in range(len(joined) - len(word), len(joined)):
                    if count(joined[:end]) > target:
                        break
                    if joined[:end].strip():
                        text = joined[:end]
                break
            return text
