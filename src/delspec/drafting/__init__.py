"""What proposes tokens: the exit head, draft vocabularies, exit adapters, context drafts."""
