"""The console's people and their sign-in: emailed links and server-side
sessions (the pages themselves are in app/http/console/)."""
