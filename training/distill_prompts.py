"""The instructions ``switchboard draft distill`` has the target answer: every template
about every topic (384), general enough that the draft learns how the target writes, none
of them the benchmark's questions (bench/spec.py), so its acceptance there is not learned
by heart."""

TOPICS = [
    "volcanoes",
    "the history of bread",
    "how batteries work",
    "saving money",
    "chess openings",
    "the moon landing",
    "composting",
    "bees",
    "writing a cover letter",
    "the French revolution",
    "machine learning",
    "gardening in small spaces",
    "the immune system",
    "jazz music",
    "climate change",
    "how to train a puppy",
    "the Roman empire",
    "recycling plastic",
    "planning a trip",
    "black holes",
    "healthy breakfasts",
    "learning to code in Python",
    "earthquakes",
    "the printing press",
    "time management",
    "electric cars",
    "coffee",
    "the human heart",
    "public speaking",
    "rain forests",
    "sorting algorithms",
    "the ocean tides",
]
TEMPLATES = [
    "Tell me about {}.",
    "Write a short paragraph explaining {} to a child.",
    "What are the most important facts about {}?",
    "Give me a list of tips related to {}.",
    "Summarize the following in two sentences: {} is a topic many people find interesting, "
    "and it has a long history with many surprising details.",
    "Explain {} in simple terms.",
    "Write a short story involving {}.",
    "What should a beginner know about {}?",
    "Why does {} matter?",
    "Describe {} step by step.",
    "Give three interesting facts about {}.",
]
