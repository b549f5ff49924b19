"""What runs leave behind and how it is read: the results store, ranking, reports, plots and the
generated leaderboard."""
