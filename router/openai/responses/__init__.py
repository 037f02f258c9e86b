"""The HTTP front's responses, in OpenAI's shapes, from the router's gRPC messages: whole ones
(whole.py: a completion or chat completion with its choices, usage and logprobs), streamed ones
(stream.py: server-sent event chunks), the logprob shapes both use (logprobs.py), the tool-call
parser of a chat's output (tool_calls.py) and the pieces they share (parts.py: finish reasons,
usage, the `pdserve` extension, SSE framing).

The generation handler (router/openai/generate.py) reads a call's first response, then hands
the call to `stream` or collects it for `whole_response`. Every function here is pure or holds
only the state of the one response it is writing.
"""
