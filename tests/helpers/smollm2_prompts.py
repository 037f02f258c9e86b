"""Eight varied prompts for the SmolLM2 cluster tests (languages, code, numbers, a longer text)."""

PROMPTS = [
    "The capital of France is",
    "La tour Eiffel a été construite en",
    "Москва — столица",
    "人工智能的发展历史可以追溯到",
    "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n",
    "SELECT name, COUNT(*) FROM orders JOIN customers ON",
    "1, 1, 2, 3, 5, 8, 13, 21,",
    "Disaggregated serving splits the prompt phase and the token generation phase of a large "
    "language model onto different machines, because the first is limited by compute and the "
    "second by memory bandwidth. A router sends each request to a prefill worker, which computes "
    "the key-value cache of the whole prompt and hands it to a decode worker. " * 4,
]
