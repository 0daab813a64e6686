"""Built-in calibration prompts: varied chat requests and plain-text openings.

The model's own continuations of these prompts are the training data of the exit adapters
(`delspec.calibration.calibrate.calibrate`). A prompt is `(text, chat)`: with `chat=True` it is
sent as one user message through the model's chat template (when it has one), otherwise as
plain text.
"""

from __future__ import annotations

PROMPTS: tuple[tuple[str, bool], ...] = (
    # chat: questions and explanations
    ("Why is the sky blue? Answer in a short paragraph.", True),
    ("What are the main differences between a virus and a bacterium?", True),
    ("Explain how a refrigerator keeps food cold.", True),
    ("Give me three tips for sleeping better.", True),
    ("What causes the seasons on Earth?", True),
    ("How do vaccines train the immune system?", True),
    ("Summarise the plot of Romeo and Juliet in a few sentences.", True),
    ("What is the difference between weather and climate?", True),
    ("Suggest a healthy breakfast and explain why it is healthy.", True),
    ("How should I prepare for a job interview?", True),
    ("Translate 'Where is the train station?' into French, Spanish and German.", True),
    ("Write a polite email asking my manager for a day off next Friday.", True),
    ("What is photosynthesis?", True),
    ("List the planets of the solar system in order from the Sun.", True),
    ("Explain what inflation is to a ten-year-old.", True),
    ("What are some good habits for learning a new language?", True),
    # chat: code
    ("Write a Python function that checks whether a string is a palindrome.", True),
    ("Explain what a hash table is and when to use one.", True),
    ("Write a SQL query that returns the ten most recent orders from a table named orders.", True),
    ("What is the difference between a list and a tuple in Python?", True),
    ("Write a JavaScript function that removes duplicates from an array.", True),
    ("How does recursion work? Give a small example.", True),
    ("Write a bash command that counts the lines of every .txt file in a folder.", True),
    # chat: math and reasoning
    ("What is 17 times 23? Show your steps.", True),
    ("A train travels 120 km in 1.5 hours. What is its average speed?", True),
    ("Solve for x: 3x + 7 = 22.", True),
    ("If I have 5 apples and give away 2, then buy 4 more, how many do I have?", True),
    ("What is the area of a circle with a radius of 4 cm?", True),
    ("Is 91 a prime number? Explain.", True),
    # chat: creative
    ("Write a short story about a robot who learns to paint.", True),
    ("Write a haiku about autumn leaves.", True),
    ("Write a limerick about a cat who loves cheese.", True),
    ("Describe a sunset over the ocean in vivid detail.", True),
    ("Invent a new holiday and describe how people celebrate it.", True),
    # plain text: facts, prose, code, lists
    ("The capital of France is", False),
    ("Once upon a time, in a small village at the edge of a forest,", False),
    ("The theory of evolution by natural selection states that", False),
    ("def fibonacci(n):\n", False),
    ("import numpy as np\n\n# Compute the mean and standard deviation of a list\n", False),
    ("The Second World War began in 1939 when", False),
    ("Water boils at 100 degrees Celsius at sea level because", False),
    ("Here is a recipe for chocolate chip cookies.\n\nIngredients:\n", False),
    ("The human heart has four chambers:", False),
    ("Dear Sir or Madam,\n\nI am writing to", False),
    ("In mathematics, a prime number is", False),
    ("The Great Wall of China is", False),
    ("Chapter 1\n\nThe rain had not stopped for three days when", False),
    ("<!DOCTYPE html>\n<html>\n<head>\n", False),
)
