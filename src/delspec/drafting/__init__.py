"""What proposes tokens: the exit head, draft vocabularies, adapters and their calibration,
context drafts."""
