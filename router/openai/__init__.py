"""The OpenAI wire format: what a request says, parsed and checked, before any worker is chosen.

`api` parses chat and completions bodies into a `ParsedRequest` (a 400 names the field),
`prompt_text` reads a prompt's text and its prefix hashes, `prompt_tokens` counts its tokens,
`responses` and `responses_pd` carry the Responses API to the prefill/decode path.
"""
