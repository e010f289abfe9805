"""One request lifecycle for every API, below HTTP.

    bytes ──parse──> body ──prepare──> Prepared ──admit──> RequestHandle ──run──> outputs ──encode──> answer
     │      (pool)          (pool)                (loop)                  (engine        (the API's
     │                                                                     thread)        encoder)
     └ the HTTP layer (entrypoints/openai) reads the body (size limit, client seats), picks the
       API's body model and encoder, and renders a ServingError in the API's shape

    parse.py        bounded parsing: depth before json.loads, finite numbers, fail-fast containers
                    (a few errors, never millions), pydantic's errors read on the pool thread
    prepare.py      the chat template, tools, reasoning, FIM, sampling params and the compiled
                    grammar of a completion or chat request (protocol.py: the two request shapes every
                    API maps onto); chat/ holds the chat pipeline (prompt, tools, parsers, reasoning)
    admission.py    prompt bounds, each client's seats, the priority range; tenancy.py: the API key
                    is the tenant; context.py: the settings and the state every step reads
    run.py          admission into the engine loop, one stream loop and one whole-answer path
    engine_loop.py  the one engine thread and its bridge to asyncio (request_stream.py)
    embeddings.py   embedding inputs, run a window at a time within the client's seats
    store.py        stored responses, per tenant; dashboard_feed.py: the cache picture, per tenant
    offline_chat.py `LLM.chat`'s use of the same chat preparation

Errors (errors.py) carry a field path and a problem, never an API's shape: each API maps the path
onto its own names. Nothing here imports the HTTP framework, the entry points or torch
(tests/test_layering.py).
"""
