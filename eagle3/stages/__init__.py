"""The five stage orchestrators (01-05): each reads its config, runs its concept packages, writes its manifest."""
